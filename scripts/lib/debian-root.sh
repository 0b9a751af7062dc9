#!/usr/bin/env bash
# Run scripts/test inside a Debian root of another release (the Slurm 24.11 lane on a Debian 12
# machine): scripts/test --debian 13 [pytest args...] lands here.
#
# The root is made once with debootstrap (minbase) under ${SLURM_IDLE_ROOT_CACHE:-/var/cache/slurm-idle}
# and reused; each run copies the host's apt/pip configuration and extra CA certificates in (a site's
# build farm reaches its mirrors the same way), mounts what the sandbox needs, copies this source
# tree to /src/slurm-idle inside (its own .venv, made for the root's Python, survives between runs)
# and runs the same scripts/test there, which installs the root's Debian packages itself.
# Mounts: the root bind-mounted onto itself (dockerd 26 refuses to import images when / is not a
# mount point), /proc, /sys recursively (a plain bind hides the cgroups dockerd looks for), /dev,
# /dev/pts and a tmpfs /run. Whatever happens (failure, Ctrl-C) the trap stops every process
# running in the root, by pid, and unmounts everything under it. A lock keeps two runs apart.
set -euo pipefail

release=${1:-}
shift || true
case "$release" in
  12) suite=bookworm ;;
  13) suite=trixie ;;
  *) echo "slurm-idle: --debian takes 12 or 13 (got '${release}')" >&2; exit 2 ;;
esac

src=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/lib/install.sh
. "$src/scripts/lib/install.sh"
# shellcheck source=scripts/lib/debian-mirror.sh
. "$src/scripts/lib/debian-mirror.sh"
_need_root

cache=${SLURM_IDLE_ROOT_CACHE:-/var/cache/slurm-idle}
root="$cache/debian$release"
stamp="$root/.slurm-idle-root"
say() { echo "slurm-idle[debian$release]: $*" >&2; }

# ---------------------------------------------------------------- mounts and processes

# Mount points at or under $1, deepest first.
mounts_under() {
  awk -v r="$1" '{ m = $5; gsub(/\\040/, " ", m); if (m == r || index(m, r "/") == 1) print length(m), m }' \
    /proc/self/mountinfo | sort -rn | cut -d' ' -f2-
}

unmount_root() {
  local m left
  [ -n "$(mounts_under "$root")" ] || return 0
  umount -R "$root" 2>/dev/null || true
  # Whatever is still mounted (busy): one by one, deepest first, lazily as a last resort.
  while read -r m; do
    [ -n "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(mounts_under "$root")
  left=$(mounts_under "$root")
  if [ -n "$left" ]; then say "could not unmount: $left"; return 1; fi
}

# Pids of live processes whose root directory is the Debian root or below it (containers that
# the root's dockerd started), all of them ours: the lock keeps other runs out. Zombies have no
# readable root and are skipped.
pids_in_root() {
  local p r
  for p in /proc/[0-9]*; do
    r=$(readlink "$p/root" 2>/dev/null) || continue
    [ "$r" = "$root" ] || [ "${r#"$root"/}" != "$r" ] || continue
    grep -q '^State:[[:space:]]*Z' "$p/status" 2>/dev/null && continue
    echo "${p#/proc/}"
  done
}

stop_processes() {
  local pids i
  pids=$(pids_in_root)
  [ -n "$pids" ] || return 0
  say "stopping $(echo "$pids" | wc -w) processes still running in the root"
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for i in $(seq 1 50); do
    pids=$(pids_in_root)
    [ -n "$pids" ] || return 0
    sleep 0.2
  done
  say "killing $(echo "$pids" | wc -w) processes that ignored SIGTERM: $(echo $pids)"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 0.5
}

ignores_sigint() {  # SigIgn of /proc/PID/status has bit 1 (SIGINT = 2) set
  local mask
  mask=$(awk '/^SigIgn:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || return 1
  [ -n "$mask" ] && (( (16#$mask >> 1) & 1 ))
}

run_pid=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$run_pid" ] && kill -0 "$run_pid" 2>/dev/null; then
    # SIGINT first, so pytest runs its fixtures' teardown (the sandbox's own `down`), unless
    # the run ignores SIGINT (started from a script without job control): then SIGTERM, and
    # the sweep below stops the daemons.
    if ! ignores_sigint "$run_pid"; then
      kill -INT -- "-$run_pid" 2>/dev/null || true
      for _ in $(seq 1 150); do kill -0 "$run_pid" 2>/dev/null || break; sleep 0.2; done
    fi
    kill -TERM -- "-$run_pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$run_pid" 2>/dev/null || break; sleep 0.2; done
  fi
  stop_processes
  unmount_root || rc=1
  exit "$rc"
}

mount_root() {
  mount --bind "$root" "$root"
  mount --make-private "$root"
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --make-rslave "$root/sys"  # unmounting our copy must never reach the host's /sys
  mount --bind /dev "$root/dev"
  mount --bind /dev/pts "$root/dev/pts"
  mount -t tmpfs -o mode=755 tmpfs "$root/run"
}

# ---------------------------------------------------------------- building the root

build_root() {
  local mirror new="$root.new" t0
  mirror=${SLURM_IDLE_DEBIAN_MIRROR:-$(mirror_of archive)}
  if [ -z "$mirror" ]; then
    say "cannot tell the Debian mirror from /etc/apt/sources*: set SLURM_IDLE_DEBIAN_MIRROR"
    exit 1
  fi
  command -v debootstrap >/dev/null || {
    say "installing debootstrap"
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  if [ -n "$(mounts_under "$new")" ]; then
    say "a previous build left mounts under $new: unmounting them"
    umount -R "$new"
  fi
  rm -rf "$new"
  say "debootstrap $suite from $mirror into $new (a few minutes, once)"
  t0=$SECONDS
  debootstrap --variant=minbase --include=ca-certificates "$suite" "$new" "$mirror" >"$cache/debootstrap-$suite.log" 2>&1 || {
    say "debootstrap failed; last lines of $cache/debootstrap-$suite.log:"
    tail -n 5 "$cache/debootstrap-$suite.log" >&2
    exit 1
  }
  say "debootstrap took $((SECONDS - t0)) s"
  rm -rf "$root"
  mv "$new" "$root"
  date -u +%FT%TZ >"$stamp"
}

# Host configuration copied in at every run, so the root follows the host's.
configure_root() {
  local archive security f
  archive=${SLURM_IDLE_DEBIAN_MIRROR:-$(mirror_of archive)}
  security=$(mirror_of security)
  {
    printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\n' "$archive" "$suite" "$suite"
    printf 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
    if [ -n "$security" ]; then
      printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\n' "$security" "$suite"
      printf 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
    fi
  } >"$root/etc/apt/sources.list.d/debian.sources"
  rm -f "$root/etc/apt/sources.list"
  # apt settings of the site (files no Debian package owns), pip's, CA certificates, names.
  for f in /etc/apt/apt.conf.d/* /etc/apt/auth.conf.d/*; do
    [ -f "$f" ] || continue
    dpkg -S "$f" >/dev/null 2>&1 && continue
    mkdir -p "$root$(dirname "$f")"
    cp -p "$f" "$root$f"
  done
  [ -f /etc/pip.conf ] && cp -p /etc/pip.conf "$root/etc/pip.conf"
  if [ -d /etc/xdg/pip ]; then mkdir -p "$root/etc/xdg"; rm -rf "$root/etc/xdg/pip"; cp -a /etc/xdg/pip "$root/etc/xdg/pip"; fi
  if [ -d /root/.config/pip ]; then mkdir -p "$root/root/.config"; rm -rf "$root/root/.config/pip"; cp -a /root/.config/pip "$root/root/.config/pip"; fi
  mkdir -p "$root/usr/local/share/ca-certificates"
  if [ -d /usr/local/share/ca-certificates ]; then
    cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
  fi
  cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  cp -L /etc/hosts "$root/etc/hosts"
}

copy_source() {
  local dest="$root/src/slurm-idle"
  mkdir -p "$dest"
  # Keep the root's own .venv (built for its Python); replace everything else.
  find "$dest" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
  tar -C "$src" --exclude=./.venv --exclude=./.git --exclude='*/__pycache__' \
      --exclude=./.pytest_cache --exclude=./.mypy_cache --exclude=./.ruff_cache \
      --exclude=./.hypothesis --exclude=./.ci/logs --exclude='*.egg-info' -cf - . \
    | tar -C "$dest" -xf -
}

# ---------------------------------------------------------------- main

# Everything runs from one function: bash has then read the whole script before it starts, so
# editing the file during a (long) run cannot change what the rest of the run does.
main() {

  mkdir -p "$cache"
  exec 9>"$cache/debian$release.lock"
  if ! flock -n 9; then
    say "another run uses $root: waiting for it"
    flock 9
  fi
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM

  stop_processes   # leftovers of a run that was SIGKILLed
  unmount_root
  t_all=$SECONDS
  [ -f "$stamp" ] || build_root
  configure_root
  rm -rf "${root:?}/tmp" && mkdir -m 1777 "$root/tmp"
  copy_source
  mount_root
  chroot "$root" update-ca-certificates >/dev/null 2>&1 || say "update-ca-certificates failed in the root"
  say "root ready in $((SECONDS - t_all)) s; running scripts/test $* inside"

  env_args=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
            TERM="${TERM:-dumb}"
            # ruff and mypy gate the code once, in the Debian 12 lane: the source is the same.
            SLURM_IDLE_LINT=0
            # A real vLLM (the `vllm` tests) does not depend on the Slurm release: it runs in
            # the Debian 12 lane, its venv built for that Python (scripts/lib/vllm-env.sh).
            SLURM_IDLE_REAL_VLLM_TESTS=0)
  # A JUnit report asked for on the host is written in the root's /tmp and copied out after.
  [ -n "${SLURM_IDLE_JUNITXML:-}" ] && env_args+=(SLURM_IDLE_JUNITXML=/tmp/slurm-idle-junit.xml)
  while IFS='=' read -r k v; do
    case "$k" in PIP_*|PYTEST_ADDOPTS|http_proxy|https_proxy|no_proxy|HTTP_PROXY|HTTPS_PROXY|NO_PROXY) env_args+=("$k=$v") ;; esac
  done < <(env)
  t_run=$SECONDS
  # setsid: the run is its own process group, so the trap can stop all of it by one pid.
  setsid chroot "$root" /usr/bin/env -i "${env_args[@]}" /bin/bash -c 'cd /src/slurm-idle && exec scripts/test "$@"' scripts/test "$@" &
  run_pid=$!
  rc=0
  wait "$run_pid" || rc=$?
  run_pid=""
  if [ -n "${SLURM_IDLE_JUNITXML:-}" ] && [ -f "$root/tmp/slurm-idle-junit.xml" ]; then
    cp "$root/tmp/slurm-idle-junit.xml" "$SLURM_IDLE_JUNITXML" || say "could not copy the test report out"
  fi
  say "scripts/test inside the root exited $rc after $((SECONDS - t_run)) s (whole lane $((SECONDS - t_all)) s)"
  exit "$rc"
}

main "$@"

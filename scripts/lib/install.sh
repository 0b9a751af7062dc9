# Shared install steps for scripts/test, scripts/demo and scripts/sandbox (sourced, not run).
# Idempotent: does nothing when everything is already there.

# man-db: systemd-analyze (257, Debian 13) runs `man` to check the units' Documentation=man:
# links; a minimal Debian 13 has none, and the units' verification test would fail.
APT_PACKAGES=(slurmctld slurmd slurm-client munge prometheus mariadb-server slurmdbd
              docker.io busybox-static prometheus-node-exporter python3-venv python3-pip lua5.3
              man-db chromium chromium-driver
              haproxy nginx-light)  # the router in front of the sandbox; nginx for its contract test
# Rootless container jobs (job_policy.runtime: podman): podman, its subuid helpers, its init.
APT_PACKAGES+=(podman uidmap catatonit)
# Unprivileged HPC containers (job_policy.runtime: charliecloud): ch-run over image directories.
APT_PACKAGES+=(charliecloud)
# The shipped journal rotation (etc/logrotate.d/slurm-idle), run for real by its contract test.
APT_PACKAGES+=(logrotate)

# Progress on stderr, one line per long step, with the seconds since the install started: the
# apt and pip steps take a minute or more on a fresh machine and print nothing themselves.
_SLURM_IDLE_T0=${_SLURM_IDLE_T0:-$SECONDS}
_progress() {
  printf 'slurm-idle: [%4ss] %s\n' "$((SECONDS - _SLURM_IDLE_T0))" "$*" >&2
}

_need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "slurm-idle: this step installs Debian packages and starts daemons: run it as root" >&2
    exit 1
  fi
}

install_system_packages() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    _need_root
    _progress "installing ${#missing[@]} Debian packages (${missing[*]}) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    # policy-rc.d keeps Debian's own service units from starting: the sandbox runs its own daemons.
    local prc=${SLURM_IDLE_POLICY_RC:-/usr/sbin/policy-rc.d} created=0
    if [ ! -e "$prc" ]; then printf '#!/bin/sh\nexit 101\n' >"$prc"; chmod +x "$prc"; created=1; fi
    local rc=0
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
    # An `if`, not `[ ] && rm`: that form returns 1 when the file was already there (Debian
    # images ship one), and `set -e` callers would stop right after the install.
    if [ "$created" = 1 ]; then rm -f "$prc"; fi
    if [ "$rc" != 0 ]; then
      echo "slurm-idle: apt-get install failed (exit $rc); see the messages above" >&2
      return "$rc"
    fi
    _progress "Debian packages installed"
  fi
  return 0
}

install_python_env() {
  local py=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    _progress "creating .venv ..."
    "$py" -m venv .venv
  fi
  local stamp=.venv/.slurm-idle-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    _progress "installing Python packages into .venv ..."
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q -e '.[test,plot,web,browser-test]'
    touch "$stamp"
    _progress "Python packages installed"
  fi
}

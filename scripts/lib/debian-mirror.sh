# The host's Debian mirror, read from its apt sources (sourced by debian-root.sh; tested alone).
# A Debian root of another release is bootstrapped from the same archive the host's apt uses,
# so no mirror host name is written anywhere in this project.

host_codename() { (. "${SLURM_IDLE_HOST_OS_RELEASE:-/etc/os-release}" && echo "${VERSION_CODENAME:-}"); }

# The URIs of the host's Debian archive and security archive, read from its apt sources
# (deb822 .sources and one-line .list): "archive URI" and "security URI" lines.
host_mirrors() {
  local codename
  codename=$(host_codename)
  [ -n "$codename" ] || return 0
  local f apt=${SLURM_IDLE_HOST_APT:-/etc/apt}
  for f in "$apt/sources.list" "$apt"/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v c="$codename" '
      $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ($(i+1) == c) print "archive", $i; else if ($(i+1) == c "-security") print "security", $i }' "$f"
  done
  for f in "$apt"/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v c="$codename" '
      function flush() { if (types ~ /(^| )deb( |$)/) { n = split(suites, s, " ");
          for (j = 1; j <= n; j++) { if (s[j] == c) kind = "archive"; else if (s[j] == c "-security") kind = "security" }
          if (kind != "") { m = split(uris, u, " "); for (j = 1; j <= m; j++) print kind, u[j] } }
        types = ""; suites = ""; uris = ""; kind = "" }
      /^[ \t]*$/ { flush(); next }
      /^#/ { next }
      tolower($1) == "types:" { $1 = ""; types = $0 }
      tolower($1) == "suites:" { $1 = ""; suites = $0 }
      tolower($1) == "uris:" { $1 = ""; uris = $0 }
      END { flush() }' "$f"
  done
}

mirror_of() {  # mirror_of archive|security
  host_mirrors | awk -v k="$1" '$1 == k { print $2; exit }'
}

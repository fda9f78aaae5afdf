# Shell helpers sourced by scripts/bootstrap and scripts/test (not run on its own).

say() { printf '\033[1m[semantic]\033[0m %s\n' "$*" >&2; }

# apt_install PACKAGE...: install Debian packages, as root directly or through sudo.
# The environment goes through `env` so that, as root (no sudo), it is not taken
# for the command.
apt_install() {
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

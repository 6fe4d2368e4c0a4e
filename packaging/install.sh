#!/usr/bin/env bash
# Install ntransformerd as a systemd service on this host.
#
#   sudo packaging/install.sh                 # unit, sysusers, tmpfiles, example config; reload
#   sudo systemctl enable --now ntransformerd
#   sudo usermod -aG ntransformer "$USER"     # then log in again; ntx-client generate "hi"
#   sudo systemctl enable --now ntx-openai    # the OpenAI HTTP API on 127.0.0.1:8000, if installed
#
# Options:
#   --bindir DIR   where ntransformerd is (default: the directory of `command -v ntransformerd`)
#   --destdir DIR  install under DIR instead of / and run no systemctl/sysusers/tmpfiles (packagers, tests)
#   --uninstall    stop the service and remove what this script installed (keeps the config)
# The Python package itself comes first: pip install 'ntransformer[daemon]' (into a venv or the system).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bindir="" destdir="" uninstall=0
while [ $# -gt 0 ]; do
    case "$1" in
        --bindir) bindir="$2"; shift 2 ;;
        --destdir) destdir="$2"; shift 2 ;;
        --uninstall) uninstall=1; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
unit="$destdir/etc/systemd/system/ntransformerd.service"
sysusers="$destdir/etc/sysusers.d/ntransformer.conf"
tmpfiles="$destdir/etc/tmpfiles.d/ntransformer.conf"
config="$destdir/etc/ntransformer/ntransformerd.toml"
openai_unit="$destdir/etc/systemd/system/ntx-openai.service"
tcp_dropin="$destdir/etc/systemd/system/ntransformerd.service.d/tcp.conf"
live=$([ -z "$destdir" ] && echo 1 || echo 0)

if [ "$live" = 1 ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (sudo $0), or pass --destdir DIR to stage the files" >&2
    exit 1
fi

if [ "$uninstall" = 1 ]; then
    [ "$live" = 1 ] && systemctl disable --now ntx-openai.service ntransformerd.service 2>/dev/null || true
    rm -f "$unit" "$openai_unit" "$tcp_dropin" "$sysusers" "$tmpfiles"
    [ "$live" = 1 ] && systemctl daemon-reload
    echo "removed the unit, sysusers and tmpfiles files; kept $config and the group ntransformer"
    exit 0
fi

if [ -z "$bindir" ]; then
    exe="$(command -v ntransformerd || true)"
    if [ -z "$exe" ]; then
        echo "install.sh: ntransformerd is not on PATH: pip install 'ntransformer[daemon]' first," \
             "or pass --bindir DIR (e.g. /opt/ntransformer/venv/bin)" >&2
        exit 1
    fi
    bindir="$(dirname "$(readlink -f "$exe")")"
    [ -x "$bindir/ntransformerd" ] || bindir="$(dirname "$exe")"
fi
if [ ! -x "$bindir/ntransformerd" ]; then
    echo "install.sh: $bindir/ntransformerd is not an executable: pass the right --bindir" >&2
    exit 1
fi

install -d -m 0755 "$(dirname "$unit")" "$(dirname "$sysusers")" "$(dirname "$tmpfiles")" "$(dirname "$config")"
sed "s|@BINDIR@|$bindir|g" "$here/systemd/ntransformerd.service" > "$unit.tmp"
chmod 0644 "$unit.tmp" && mv "$unit.tmp" "$unit"
install -m 0644 "$here/sysusers.d/ntransformer.conf" "$sysusers"
install -m 0644 "$here/tmpfiles.d/ntransformer.conf" "$tmpfiles"
if [ ! -e "$config" ]; then
    install -m 0644 "$here/ntransformerd.toml" "$config"
else
    echo "kept the existing $config"
fi
echo "installed $unit (ExecStart=$bindir/ntransformerd), $sysusers, $tmpfiles, $config"
# The unit has no network unless the config serves TCP: run install.sh again after changing tcp_listen.
if grep -Eq '^[[:space:]]*tcp_listen[[:space:]]*=[[:space:]]*"[^"]+"' "$config"; then
    install -d -m 0755 "$(dirname "$tcp_dropin")"
    install -m 0644 "$here/systemd/ntransformerd.service.d/tcp.conf" "$tcp_dropin"
    echo "installed $tcp_dropin (tcp_listen is set: the unit may use the network)"
else
    rm -f "$tcp_dropin"
fi
# the gateway's unit, where the gateway is installed (pip install 'ntransformer[openai]')
if [ -x "$bindir/ntx-openai" ]; then
    sed "s|@BINDIR@|$bindir|g" "$here/systemd/ntx-openai.service" > "$openai_unit.tmp"
    chmod 0644 "$openai_unit.tmp" && mv "$openai_unit.tmp" "$openai_unit"
    echo "installed $openai_unit (ExecStart=$bindir/ntx-openai)"
fi

if [ "$live" = 1 ]; then
    systemd-sysusers "$sysusers"
    systemd-tmpfiles --create "$tmpfiles"
    systemctl daemon-reload
    cat <<MSG
next:
  systemctl enable --now ntransformerd      # returns once the model is loaded (READY=1)
  usermod -aG ntransformer <user>           # then that user logs in again
  ntx-client generate "Why is the sky blue?"
  journalctl -u ntransformerd               # the daemon's log
MSG
fi

#!/usr/bin/env bash
# Install mxtrain's offline data sets (idempotent; safe to re-run).
#
#   * Fashion-MNIST: `apt-get install dataset-fashion-mnist`
#       -> /usr/share/datasets/fashion-mnist/*-idx?-ubyte.gz
#   * Jane Austen's novels: `apt-get download r-cran-janeaustenr` + `dpkg-deb -x`
#       -> $MXTRAIN_DATA_DIR/janeaustenr (default ~/.cache/mxtrain/janeaustenr).
#     The package is NOT apt-installed, because that would pull in R.
#
# Runs `apt-get update` only when a package has no install candidate or a
# download fails. Uses sudo for apt-get install when not root (if available).
# Python side needs: pip install 'rdata>=1.0' (reads the R data), numpy, torch.
#
# Usage: bash scripts/install_data.sh [--fashion-mnist-only|--austen-only]
set -euo pipefail

want_fmnist=1
want_austen=1
case "${1:-}" in
  --fashion-mnist-only) want_austen=0 ;;
  --austen-only) want_fmnist=0 ;;
  "") ;;
  -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
  *) echo "unknown option: $1" >&2; exit 2 ;;
esac

DATA_DIR="${MXTRAIN_DATA_DIR:-$HOME/.cache/mxtrain}"
AUSTEN_DIR="$DATA_DIR/janeaustenr"
AUSTEN_PKG_SUB="usr/lib/R/site-library/janeaustenr"
FMNIST_DIR="/usr/share/datasets/fashion-mnist"

log() { echo "[install_data] $*"; }
die() { echo "[install_data] ERROR: $*" >&2; exit 1; }

command -v apt-get >/dev/null 2>&1 || die "apt-get not found: this script needs a Debian/Ubuntu system"

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    SUDO=(__no_root__)
  fi
fi
as_root() {
  if [ "${SUDO[0]:-}" = "__no_root__" ]; then
    die "need root for: $* (not root and sudo is not available)"
  fi
  "${SUDO[@]}" "$@"
}

export DEBIAN_FRONTEND=noninteractive
APT_UPDATED=0
apt_update_once() {
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt-get update"
    as_root apt-get update -q
    APT_UPDATED=1
  fi
}
has_candidate() {  # is the package known to apt's current lists?
  local cand
  cand="$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p')"
  [ -n "$cand" ] && [ "$cand" != "(none)" ]
}
ensure_known() {
  has_candidate "$1" || apt_update_once
  has_candidate "$1" || die "package $1 is not available from the configured apt sources"
}

# ---------------------------------------------------------------- Fashion-MNIST
install_fmnist() {
  if dpkg-query -W -f='${Status}' dataset-fashion-mnist 2>/dev/null | grep -q "ok installed" \
     && [ -s "$FMNIST_DIR/train-images-idx3-ubyte.gz" ] && [ -s "$FMNIST_DIR/t10k-labels-idx1-ubyte.gz" ]; then
    log "Fashion-MNIST already installed in $FMNIST_DIR"
    return
  fi
  ensure_known dataset-fashion-mnist
  log "apt-get install dataset-fashion-mnist (~30 MB)"
  if ! as_root apt-get install -y -q --no-install-recommends dataset-fashion-mnist; then
    [ "$APT_UPDATED" -eq 1 ] && die "apt-get install dataset-fashion-mnist failed"
    apt_update_once   # stale lists (404) -> refresh and retry once
    as_root apt-get install -y -q --no-install-recommends dataset-fashion-mnist
  fi
  [ -s "$FMNIST_DIR/train-images-idx3-ubyte.gz" ] || die "dataset-fashion-mnist installed but $FMNIST_DIR is missing files"
  log "Fashion-MNIST installed in $FMNIST_DIR"
}

# ---------------------------------------------------------------- Jane Austen
install_austen() {
  if [ -s "$AUSTEN_DIR/$AUSTEN_PKG_SUB/data/Rdata.rdb" ] && [ -s "$AUSTEN_DIR/$AUSTEN_PKG_SUB/data/Rdata.rdx" ]; then
    log "Jane Austen corpus already in $AUSTEN_DIR"
    return
  fi
  command -v dpkg-deb >/dev/null 2>&1 || die "dpkg-deb not found"
  ensure_known r-cran-janeaustenr
  mkdir -p "$DATA_DIR"
  local dl stage
  dl="$(mktemp -d)"                                   # download dir (world-traversable /tmp)
  stage="$(mktemp -d "$DATA_DIR/.janeaustenr.XXXXXX")"  # same filesystem as the target, for mv
  # shellcheck disable=SC2064
  trap "rm -rf '$dl' '$stage'" EXIT
  # Let apt's unprivileged _apt user write there (avoids the 'unsandboxed' warning as root).
  if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then chown _apt "$dl" 2>/dev/null || true; fi
  log "apt-get download r-cran-janeaustenr (~1.6 MB)"
  if ! (cd "$dl" && apt-get download -q r-cran-janeaustenr); then
    [ "$APT_UPDATED" -eq 1 ] && die "apt-get download r-cran-janeaustenr failed"
    apt_update_once
    (cd "$dl" && apt-get download -q r-cran-janeaustenr)
  fi
  local debs deb
  debs=("$dl"/r-cran-janeaustenr_*.deb)
  deb="${debs[0]}"
  [ -f "$deb" ] || die "apt-get download produced no .deb"
  mkdir -p "$stage/x"
  dpkg-deb -x "$deb" "$stage/x"
  [ -s "$stage/x/$AUSTEN_PKG_SUB/data/Rdata.rdb" ] || die "unexpected layout in $(basename "$deb"): no $AUSTEN_PKG_SUB/data/Rdata.rdb"
  # A half-extracted folder never sits at $AUSTEN_DIR.
  rm -rf "$AUSTEN_DIR"
  mv "$stage/x" "$AUSTEN_DIR"
  chmod -R a+rX "$AUSTEN_DIR"
  log "Jane Austen corpus extracted to $AUSTEN_DIR"
}

[ "$want_fmnist" -eq 1 ] && install_fmnist
[ "$want_austen" -eq 1 ] && install_austen

PY="${PYTHON:-python3}"
if command -v "$PY" >/dev/null 2>&1 && ! "$PY" -c "import rdata" >/dev/null 2>&1; then
  log "note: the Python package 'rdata' is needed to read the Austen corpus: pip install 'rdata>=1.0'"
fi
log "done"

#!/usr/bin/env bash
# Overlay vllm_patches/*.py onto the vLLM install of the current Python (or --vllm-root DIR).
#
#   bash apply_patches.sh            apply (idempotent); also makes `import cutedsl` work there
#   bash apply_patches.sh --check    report applied / not applied / drifted per file
#                                    (exit 0 all applied, 1 some not applied, 2 drifted or refused)
#   bash apply_patches.sh --revert   restore the pristine upstream files byte for byte
#   bash apply_patches.sh --diff     unified diff of each overlay against its pristine upstream file
#
# Options: --vllm-root DIR (the `vllm` package directory; default: found via $PYTHON),
#          --no-install (skip making `import cutedsl` resolve to this checkout; for a --vllm-root copy).
# Environment: PYTHON (default python3).
#
# vllm_patches/UPSTREAM pins the vLLM version and the sha256 of each pristine file. Pristine copies
# are kept in <vllm>/.cutedsl_pristine/ while the overlay is applied. Every change is validated first
# and made by rename; on any failure the files already changed are put back as they were.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MANIFEST="$HERE/vllm_patches/UPSTREAM"
PYTHON=${PYTHON:-python3}
case "$PYTHON" in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac
MODE=apply
VLLM_ROOT=""
INSTALL=1

die() {
    echo "apply_patches.sh: error: $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --check) MODE=check ;;
        --revert) MODE=revert ;;
        --diff) MODE=diff ;;
        --no-install) INSTALL=0 ;;
        --vllm-root)
            [ $# -ge 2 ] || die "--vllm-root needs a directory"
            VLLM_ROOT=$2
            shift
            ;;
        -h | --help)
            sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

sha() { sha256sum "$1" | cut -d' ' -f1; }

# --- the manifest -----------------------------------------------------------------------------
[ -f "$MANIFEST" ] || die "manifest $MANIFEST not found"
EXPECTED_VERSION=""
NAMES=()
PATHS=()
HASHES=()
while read -r a b c; do
    case "$a" in "" | \#*) continue ;; esac
    if [ "$a" = vllm_version ]; then
        EXPECTED_VERSION=$b
    else
        [ -n "$c" ] || die "malformed line in $MANIFEST: '$a $b'"
        [ -f "$HERE/vllm_patches/$a" ] || die "overlay vllm_patches/$a (listed in $MANIFEST) is missing"
        NAMES+=("$a")
        PATHS+=("$b")
        HASHES+=("$c")
    fi
done <"$MANIFEST"
[ -n "$EXPECTED_VERSION" ] || die "$MANIFEST has no 'vllm_version' line"

# --- the vLLM install -------------------------------------------------------------------------
if [ -z "$VLLM_ROOT" ]; then
    VLLM_ROOT=$(cd / && "$PYTHON" -c '
import importlib.util, sys
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    sys.exit("vllm is not installed for " + sys.executable)
print(spec.submodule_search_locations[0])') || die "no vLLM found for PYTHON=$PYTHON"
fi
[ -d "$VLLM_ROOT" ] || die "vLLM directory $VLLM_ROOT does not exist"
VLLM_ROOT=$(cd "$VLLM_ROOT" && pwd)
BACKUP="$VLLM_ROOT/.cutedsl_pristine"
FOUND_VERSION=$(sed -n "s/^__version__ = version = '\(.*\)'\$/\1/p" "$VLLM_ROOT/_version.py" 2>/dev/null || true)
FOUND_VERSION=${FOUND_VERSION:-unknown}

require_version() {
    [ "$FOUND_VERSION" = "$EXPECTED_VERSION" ] ||
        die "vLLM version mismatch at $VLLM_ROOT: expected $EXPECTED_VERSION, found $FOUND_VERSION; nothing changed"
}

# The pristine file for entry i: the backup while applied, else the installed file. Refuses a
# pristine file whose hash differs from the manifest (a different vLLM build, or tampering).
pristine_of() {
    local i=$1 path=${PATHS[$1]} want=${HASHES[$1]} got
    if [ -f "$BACKUP/$path" ]; then
        got=$(sha "$BACKUP/$path")
        [ "$got" = "$want" ] ||
            die "pristine backup $BACKUP/$path was modified: expected sha256 $want, found $got; nothing changed"
        echo "$BACKUP/$path"
    else
        [ -f "$VLLM_ROOT/$path" ] || die "$VLLM_ROOT/$path does not exist; nothing changed"
        got=$(sha "$VLLM_ROOT/$path")
        if [ "$got" != "$want" ]; then
            if [ "$got" = "$(sha "$HERE/vllm_patches/${NAMES[$i]}")" ]; then
                die "$VLLM_ROOT/$path already equals our overlay but no pristine backup exists in $BACKUP; reinstall vllm==$EXPECTED_VERSION"
            fi
            die "pristine file $VLLM_ROOT/$path does not match vllm==$EXPECTED_VERSION: expected sha256 $want, found $got; nothing changed"
        fi
        echo "$VLLM_ROOT/$path"
    fi
}

# --- transactions: every replaced file is saved first and put back on failure -------------------
TXN=$(mktemp -d)
CHANGED=()   # installed paths replaced so far (their previous content is in $TXN)
NEW_BACKUPS=()
rollback() {
    local rc=$? k p
    trap - ERR EXIT
    set +e
    if [ "$rc" -ne 0 ]; then
        for k in "${!CHANGED[@]}"; do
            p=${CHANGED[$k]}
            cp -p "$TXN/$k" "$p.cutedsl-tmp" && mv -f "$p.cutedsl-tmp" "$p"
        done
        for p in "${NEW_BACKUPS[@]}"; do rm -f "$p"; done
        [ ${#CHANGED[@]} -eq 0 ] || echo "apply_patches.sh: rolled back ${#CHANGED[@]} file(s)" >&2
    fi
    rm -rf "$TXN"
    exit "$rc"
}
trap rollback EXIT
trap 'exit 2' ERR

# Replace $2 with the content of $1 by rename, after saving $2's current content.
replace() {
    local src=$1 dst=$2 k=${#CHANGED[@]}
    cp -p "$dst" "$TXN/$k"
    cp "$src" "$dst.cutedsl-tmp"
    mv -f "$dst.cutedsl-tmp" "$dst"
    CHANGED+=("$dst")
}

ensure_cutedsl_importable() {
    if (cd / && "$PYTHON" -c '
import os, sys
import cutedsl
sys.exit(0 if os.path.realpath(cutedsl.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 3)
' "$HERE/cutedsl") 2>/dev/null; then
        return 0
    fi
    echo "apply_patches.sh: installing $HERE (editable) for $PYTHON"
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e "$HERE" ||
        die "pip install -e $HERE failed; nothing changed"
}

# --- modes ------------------------------------------------------------------------------------
case "$MODE" in
check)
    echo "vLLM $FOUND_VERSION at $VLLM_ROOT (overlays pinned to $EXPECTED_VERSION)"
    worst=0
    [ "$FOUND_VERSION" = "$EXPECTED_VERSION" ] || { echo "  version mismatch"; worst=2; }
    for i in "${!NAMES[@]}"; do
        path=${PATHS[$i]}
        inst="$VLLM_ROOT/$path"
        if [ ! -f "$inst" ]; then
            state="drifted (missing)"; rc=2
        else
            h=$(sha "$inst")
            have_backup=0
            [ -f "$BACKUP/$path" ] && [ "$(sha "$BACKUP/$path")" = "${HASHES[$i]}" ] && have_backup=1
            ov_sha=$(sha "$HERE/vllm_patches/${NAMES[$i]}")
            if [ "$h" = "$ov_sha" ] && { [ "$have_backup" = 1 ] || [ "$h" = "${HASHES[$i]}" ]; }; then
                state=applied; rc=0  # (an overlay identical to upstream is applied by definition)
            elif [ "$h" = "${HASHES[$i]}" ]; then
                state="not applied"; rc=1
            elif [ -f "$BACKUP/$path" ] && [ "$have_backup" = 0 ]; then
                state="drifted (pristine backup modified)"; rc=2
            else
                state="drifted (neither pristine nor our overlay)"; rc=2
            fi
        fi
        printf '  %-12s %s\n' "$state" "$path"
        [ "$rc" -le "$worst" ] || worst=$rc
    done
    trap - EXIT; rm -rf "$TXN"
    exit "$worst"
    ;;
diff)
    for i in "${!NAMES[@]}"; do
        p=$(pristine_of "$i")
        diff -u --label "a/vllm/${PATHS[$i]}" --label "b/vllm_patches/${NAMES[$i]}" \
            "$p" "$HERE/vllm_patches/${NAMES[$i]}" || [ $? -eq 1 ]
    done
    ;;
apply)
    require_version
    SRC=()
    for i in "${!NAMES[@]}"; do
        SRC+=("$(pristine_of "$i")")
        "$PYTHON" -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' \
            "$HERE/vllm_patches/${NAMES[$i]}" || die "vllm_patches/${NAMES[$i]} does not parse; nothing changed"
    done
    [ "$INSTALL" = 0 ] || ensure_cutedsl_importable
    n=0
    for i in "${!NAMES[@]}"; do
        path=${PATHS[$i]}
        inst="$VLLM_ROOT/$path"
        ov="$HERE/vllm_patches/${NAMES[$i]}"
        if [ "$(sha "$inst")" = "$(sha "$ov")" ]; then
            echo "  already applied  $path"
            continue
        fi
        if [ ! -f "$BACKUP/$path" ]; then
            mkdir -p "$(dirname "$BACKUP/$path")"
            cp -p "${SRC[$i]}" "$BACKUP/$path.cutedsl-tmp"
            mv -f "$BACKUP/$path.cutedsl-tmp" "$BACKUP/$path"
            NEW_BACKUPS+=("$BACKUP/$path")
        fi
        replace "$ov" "$inst"
        echo "  applied          $path"
        n=$((n + 1))
    done
    echo "apply_patches.sh: $n file(s) changed in vLLM $FOUND_VERSION at $VLLM_ROOT"
    ;;
revert)
    require_version
    SRC=()
    for i in "${!NAMES[@]}"; do
        path=${PATHS[$i]}
        if [ -f "$BACKUP/$path" ]; then
            SRC+=("$(pristine_of "$i")")
        elif [ -f "$VLLM_ROOT/$path" ] && [ "$(sha "$VLLM_ROOT/$path")" = "${HASHES[$i]}" ]; then
            SRC+=("")
        else
            die "cannot revert $VLLM_ROOT/$path: no pristine backup in $BACKUP and the installed file is not pristine; reinstall vllm==$EXPECTED_VERSION"
        fi
    done
    n=0
    for i in "${!NAMES[@]}"; do
        path=${PATHS[$i]}
        if [ -z "${SRC[$i]}" ]; then
            echo "  already pristine $path"
            continue
        fi
        replace "${SRC[$i]}" "$VLLM_ROOT/$path"
        echo "  reverted         $path"
        n=$((n + 1))
    done
    # Only now, with every file restored, drop the backups.
    for i in "${!NAMES[@]}"; do rm -f "$BACKUP/${PATHS[$i]}"; done
    [ ! -d "$BACKUP" ] || find "$BACKUP" -depth -type d -empty -delete
    echo "apply_patches.sh: $n file(s) restored in vLLM $FOUND_VERSION at $VLLM_ROOT"
    ;;
esac

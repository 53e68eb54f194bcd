# Sourced by .ci/run and .ci/lm_eval.sh: a virtual environment under target/ci/ with
# lm-evaluation-harness and what its `hf` backend needs (transformers, torch, huggingface_hub),
# made once. Sets LM_EVAL_VENV and GPT_TEST_PYTHON (the Python the Rust tests run their
# transformers and huggingface_hub checks with).
LM_EVAL_VENV=${LM_EVAL_VENV:-target/ci/venv-lm-eval}
if [ ! -x "$LM_EVAL_VENV/bin/lm_eval" ]; then
  python3 -m venv "$LM_EVAL_VENV"
  "$LM_EVAL_VENV/bin/pip" install -q --disable-pip-version-check "lm_eval[api,hf]==0.4.13"
fi
export LM_EVAL_VENV
GPT_TEST_PYTHON="$(cd "$(dirname "$LM_EVAL_VENV")" && pwd)/$(basename "$LM_EVAL_VENV")/bin/python"
export GPT_TEST_PYTHON

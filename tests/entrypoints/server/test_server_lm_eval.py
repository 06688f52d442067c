"""EleutherAI's lm-evaluation-harness as a third-party client of the server.

Its ``local-completions`` model, given only the completions URL and the model's name, finds the
tokenizer through the server (``GET /tokenizer_info`` and ``POST /tokenize``: its "remote"
tokenizer) and scores a small loglikelihood task written here (echoed prompts with logprobs).
Each sample's log-likelihood equals the one computed from :meth:`metrale.LLM.score` with NumPy,
and the harness's own transformers backend on the same checkpoint gives the same numbers once it
too adds no BOS (``add_bos_token=False``): the harness's remote tokenizer never asks for special
tokens. Told the tokenizer folder and ``add_bos_token=True`` instead, ``local-completions``
matches that backend's default (a BOS before every context)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("openai")
lm_eval = pytest.importorskip("lm_eval")
for _module in ("aiohttp", "tenacity", "requests"):  # lm_eval[api]
    pytest.importorskip(_module)
pytest.importorskip("lm_eval.models.openai_completions")
if not hasattr(pytest.importorskip("lm_eval.utils"), "RemoteTokenizer"):
    pytest.skip("this lm_eval has no remote tokenizer (local-completions needs a local one)", allow_module_level=True)

from serverkit import MODEL, Stack, new_llm  # noqa: E402

TASK = "metrale_loglikelihood"
SAMPLES = [
    {"context": "Return the", "continuation": " value of the list"},
    {"context": "Open a file and", "continuation": " read it"},
    {"context": "Le café ☕ est", "continuation": " naïve"},
    {"context": "", "continuation": "The number of items"},
]


@pytest.fixture(scope="module")
def stack():
    stack = Stack()
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def reference():
    llm = new_llm()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """A task folder for the harness's TaskManager: the samples as JSON lines and a task YAML."""
    folder = tmp_path_factory.mktemp("lm-eval-task")
    (folder / "samples.jsonl").write_text("".join(json.dumps(sample, ensure_ascii=False) + "\n" for sample in SAMPLES),
                                          encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "samples.jsonl"}
  cache_dir: {folder / "datasets-cache"}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""", encoding="utf-8")
    return folder


def evaluate(task_folder, model, model_args):
    """Each sample's log-likelihood (by context and continuation) as the harness computes it."""
    from lm_eval.tasks import TaskManager

    # (The harness's own tasks are not indexed: the one written here is all it runs. No seeds:
    # the harness would seed this process's generators.)
    tasks = TaskManager(include_path=str(task_folder), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tasks,
                                      log_samples=True, bootstrap_iters=0, random_seed=None, numpy_random_seed=None,
                                      torch_random_seed=None, fewshot_random_seed=None)
    scores = {}
    for sample in results["samples"][TASK]:
        loglikelihood, _ = sample["filtered_resps"][0]
        scores[(sample["doc"]["context"], sample["doc"]["continuation"])] = float(loglikelihood)
    assert len(scores) == len(SAMPLES)
    return scores


def reference_scores(llm, add_bos):
    """The samples' log-likelihoods from :meth:`LLM.score`: the continuation's tokens (split off
    the whole text's encoding as the harness splits them) scored after the context's, the context
    led by a BOS with ``add_bos`` (an empty context is the end-of-sequence token, as the harness
    puts it), log-softmax in float64."""
    scores = {}
    for sample in SAMPLES:
        context, continuation = sample["context"], sample["continuation"]
        if context:
            whole = llm.encode(context + continuation, add_special_tokens=add_bos)
            start = len(llm.encode(context, add_special_tokens=add_bos))
        else:
            whole = [llm.eos_token_ids[0], *llm.encode(continuation, add_special_tokens=False)]
            start = 1
        logits = np.asarray(llm.score(whole), dtype=np.float64)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        scores[(context, continuation)] = float(sum(log_probs[position - 1, whole[position]]
                                                    for position in range(start, len(whole))))
    return scores


def test_local_completions_with_only_the_url_and_model_name(stack, reference, task_folder, caplog):
    caplog.set_level("INFO")
    scores = evaluate(task_folder, "local-completions", {"model": MODEL, "base_url": f"{stack.url}/v1/completions"})
    assert "remote tokenizer" in caplog.text.lower()
    expected = reference_scores(reference, add_bos=False)
    for key, value in expected.items():
        assert scores[key] == pytest.approx(value, abs=1e-4), key


def test_local_completions_matches_the_harness_transformers_backend(stack, reference, task_folder):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = str(reference.checkpoint.path)
    hf_args = {"pretrained": folder, "dtype": "float32", "device": "cpu"}
    without_bos = evaluate(task_folder, "hf", {**hf_args, "add_bos_token": False})
    served = evaluate(task_folder, "local-completions", {"model": MODEL, "base_url": f"{stack.url}/v1/completions"})
    for key, value in served.items():
        assert value == pytest.approx(without_bos[key], abs=1e-4), key
    with_bos = evaluate(task_folder, "hf", hf_args)
    told = evaluate(task_folder, "local-completions", {"model": MODEL, "base_url": f"{stack.url}/v1/completions",
                                                       "tokenizer_backend": "huggingface", "tokenizer": folder,
                                                       "add_bos_token": True})
    expected = reference_scores(reference, add_bos=True)
    for key, value in told.items():
        assert value == pytest.approx(with_bos[key], abs=1e-4), key
        if key[0]:
            assert value == pytest.approx(expected[key], abs=1e-4), key

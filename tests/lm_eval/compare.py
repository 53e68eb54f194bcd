"""Checks that two lm-eval runs scored the same: every document's log-likelihoods (and greedy
flags) and every aggregate metric, within a relative tolerance.

    python tests/lm_eval/compare.py RUN_DIR REFERENCE_DIR [RTOL=1e-4]

RUN_DIR and REFERENCE_DIR are lm_eval --output_path folders written with --log_samples.
"""
import glob
import json
import math
import os
import sys


def load(run: str):
    results = {}
    for path in glob.glob(os.path.join(run, "**", "results_*.json"), recursive=True):
        results.update(json.load(open(path))["results"])
    samples = {}
    for path in glob.glob(os.path.join(run, "**", "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path)[len("samples_") :].rsplit("_", 1)[0]
        with open(path) as f:
            samples[task] = {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, f)}
    if not results or not samples:
        sys.exit(f"{run}: no lm_eval results or samples (run with --output_path and --log_samples)")
    return results, samples


def close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0) or a == b


def scores(resp):
    """(log-likelihoods, greedy flags) of one document's filtered responses."""
    items = resp if isinstance(resp[0], list) else [resp]
    return [float(x[0]) for x in items], [x[1] for x in items if len(x) > 1]


def main() -> None:
    run, ref = sys.argv[1], sys.argv[2]
    rtol = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-4
    (run_results, run_samples), (ref_results, ref_samples) = load(run), load(ref)
    failures, compared, worst = [], 0, 0.0
    for task, ref_docs in sorted(ref_samples.items()):
        docs = run_samples.get(task, {})
        if set(docs) != set(ref_docs):
            failures.append(f"{task}: documents {sorted(docs)} vs {sorted(ref_docs)}")
            continue
        for doc_id, ref_resp in sorted(ref_docs.items()):
            (a, ga), (b, gb) = scores(docs[doc_id]), scores(ref_resp)
            for x, y in zip(a, b):
                compared += 1
                worst = max(worst, abs(x - y) / max(abs(y), 1e-30))
                if not close(x, y, rtol):
                    failures.append(f"{task} doc {doc_id}: log-likelihood {x} vs {y}")
            if len(a) != len(b) or ga != gb:
                failures.append(f"{task} doc {doc_id}: {docs[doc_id]} vs {ref_resp}")
    for task, metrics in sorted(ref_results.items()):
        for name, value in metrics.items():
            if isinstance(value, float) and "stderr" not in name:
                other = run_results.get(task, {}).get(name)
                print(f"{task:20} {name:24} {other!r:>24} {value!r:>24}")
                if not isinstance(other, float) or not close(other, value, rtol):
                    failures.append(f"{task} {name}: {other} vs {value}")
    print(f"{compared} log-likelihoods compared; largest relative difference {worst:.2e} (tolerance {rtol:g})")
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures[:20]))
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Writes the data of the lm-eval tasks in this folder from a corpus (tinyshakespeare):

    python tests/lm_eval/make_data.py data/tinyshakespeare.txt target/ci/lm_eval 12

paragraphs.jsonl  the first N paragraphs (blank-line separated), {"text": ...}, for the rolling
                  perplexity task gptrs_paragraphs
mc.jsonl          16 questions: a paragraph's first line, and as choices its second line and the
                  second lines of three other paragraphs, {"context", "choices", "label"}, for the
                  multiple-choice task gptrs_next_line
Nothing random: the same corpus gives the same files.
"""
import json
import pathlib
import sys


def main() -> None:
    corpus, out, n = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    paragraphs = [p.strip() for p in corpus.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    with open(out / "paragraphs.jsonl", "w", encoding="utf-8") as f:
        for p in paragraphs[:n]:
            f.write(json.dumps({"text": p}) + "\n")
    # Paragraphs of at least three lines: speaker, first line, second line.
    pool = [p.split("\n") for p in paragraphs if p.count("\n") >= 2][:64]
    with open(out / "mc.jsonl", "w", encoding="utf-8") as f:
        for q in range(16):
            lines = pool[q]
            others = [pool[(q + k * 13) % len(pool)][2] for k in (1, 2, 3)]
            label = q % 4
            choices = others[:label] + [lines[2]] + others[label:]
            f.write(json.dumps({"context": lines[0] + "\n" + lines[1] + "\n", "choices": choices, "label": label}) + "\n")


if __name__ == "__main__":
    main()

"""The chat fine-tuning example of docs/training.md, measured: how often a model ends its turn (the chat
template's end of turn, `finish_reason` "stop") when asked held-out questions, greedily, within
a length limit; and a few samples. Runs against a gpt-server that serves the base and the
adapter under the given model names.

    python bench/chat_turns.py URL CONVERSATIONS.jsonl SKIP COUNT MODEL [MODEL ...]

The questions are the user turns of lines SKIP.. SKIP+COUNT of CONVERSATIONS (what
bench/shakespeare_chat.py writes; the first SKIP trained the adapter).
"""
import json
import sys
import urllib.request


def ask(url, model, question, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 160}
    body.update(extra)
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        choice = json.load(resp)["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def main():
    url, path, skip, count, models = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    lines = open(path).read().splitlines()[skip : skip + count]
    questions = [json.loads(line)["messages"][0]["content"] for line in lines]
    for model in models:
        ended = sum(ask(url, model, q, temperature=0)[1] == "stop" for q in questions)
        print(f"{model}: ended its turn {ended}/{len(questions)} times (greedy, at most 160 tokens)")
    for q in questions[:3]:
        print(f"\n{q}")
        for model in models:
            greedy, _ = ask(url, model, q, temperature=0)
            sampled, _ = ask(url, model, q, temperature=0.8, seed=1)
            print(f"  {model} (greedy): {greedy!r}\n  {model} (0.8, seed 1): {sampled!r}")


if __name__ == "__main__":
    main()

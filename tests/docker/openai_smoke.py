"""The official `openai` client against a gpt-server container serving the default model, as the
README's first examples call it (`model="default"`): a completion and a chat turn, whole and
streamed. Exits non-zero on any failure.

    python tests/docker/openai_smoke.py http://127.0.0.1:18190/v1
"""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
assert [m.id for m in client.models.list().data] == ["default"]
whole = client.completions.create(model="default", prompt="ROMEO:", max_tokens=40, temperature=0)
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model="default", prompt="ROMEO:", max_tokens=40, temperature=0, stream=True) if c.choices)
assert whole.choices[0].text and streamed == whole.choices[0].text, (whole, streamed)
messages = [{"role": "user", "content": "What news?"}]
chat = client.chat.completions.create(model="default", messages=messages, max_completion_tokens=60, temperature=0)
chunks = client.chat.completions.create(model="default", messages=messages, max_completion_tokens=60, temperature=0, stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert chat.choices[0].message.content and streamed == chat.choices[0].message.content, (chat, streamed)
print(f"openai {openai.__version__} through the container: completions and chat, whole and streamed OK")

"""Replicas behind the load balancer of docker-compose.lb.yml: 32 concurrent completions through
the balancer all succeed and both replicas answer some (their own request counts in /metrics);
then one replica is killed while requests keep coming, and every request sent after the kill
succeeds (the balancer retries a refused connection on the other replica).

    python tests/docker/lb_check.py http://127.0.0.1:8080 8081 8082 "COMMAND THAT KILLS THE SECOND"
"""
import concurrent.futures as futures
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

balancer, port_a, port_b, kill = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]


def complete(i):
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 16, "temperature": 0.8, "seed": i}).encode()
    request = urllib.request.Request(balancer + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status == 200 and bool(json.load(resp)["choices"][0]["text"])
    except Exception as e:  # a failed request is counted, not raised
        print(f"request {i}: {e}")
        return False


def served(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(v) for v in re.findall(r'^gpt_requests_total\{route="/v1/completions",status="200"\} (\S+)$', text, re.M))


with futures.ThreadPoolExecutor(32) as pool:
    results = list(pool.map(complete, range(32)))
counts = served(port_a), served(port_b)
assert all(results), f"{results.count(False)} of 32 requests failed"
assert all(c > 0 for c in counts), f"requests per replica: {counts}"
print(f"32 concurrent requests through the balancer: all answered; per replica {counts[0]:.0f} and {counts[1]:.0f}")

# A replica dies mid-run: requests sent after it are all answered by the other.
outcomes = []  # (sent at, ok)
lock = threading.Lock()
stop = threading.Event()


def client(k):
    i = 0
    while not stop.is_set():
        sent = time.monotonic()
        ok = complete(1000 * k + i)
        with lock:
            outcomes.append((sent, ok))
        i += 1


threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
for t in threads:
    t.start()
time.sleep(3)
killed_at = time.monotonic()
subprocess.run(kill, shell=True, check=True, capture_output=True)
time.sleep(5)
stop.set()
for t in threads:
    t.join()
after = [ok for sent, ok in outcomes if sent > killed_at]
before = [ok for sent, ok in outcomes if sent <= killed_at]
assert after and all(after), f"{after.count(False)} of {len(after)} requests sent after the kill failed"
print(f"one replica killed: {len(after)} requests sent after it all answered "
      f"({before.count(False)} of {len(before)} in flight before it failed)")

"""The soak's latency rule (bench/soak.py) on made-up runs: what it passes and what it fails; and
how the drift probe (bench/soak_probe.py) shares the load between the two servers and judges them.

    python3 -m unittest discover -s bench -p 'test_*.py'
"""
import os
import random
import http.server
import json
import socket
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak  # noqa: E402
import soak_probe  # noqa: E402
import soak_verdict  # noqa: E402


def run(ttft_p99, ttft_p50=0.02, itl_p50=0.005, itl_p99=0.1):
    """Per-minute rows with the given TTFT p99 each minute (the other latencies constant unless
    given as lists)."""
    pick = lambda v, m: v[m] if isinstance(v, list) else v  # noqa: E731
    return [{"minute": m, "ttft_p50": pick(ttft_p50, m), "ttft_p99": v, "itl_p50": pick(itl_p50, m),
             "itl_p99": pick(itl_p99, m)} for m, v in enumerate(ttft_p99)]


# A stationary run as the 30-minute soaks measure one: a minute's TTFT p99 moves 0.4-1.1 s with
# the bursts in it, with no direction.
NOISY = [0.73, 0.97, 0.93, 0.43, 0.71, 0.89, 1.13, 0.52, 0.80, 0.66, 1.05, 0.47, 0.95, 0.61, 0.74,
         0.88, 0.42, 1.09, 0.69, 0.78, 0.58, 0.99, 0.83, 0.45, 1.02, 0.64, 0.91, 0.72, 0.55, 0.86]


class LatencyRule(unittest.TestCase):
    def test_a_noisy_run_without_direction_is_steady(self):
        rows = run(NOISY)
        ok, detail = soak.steady(soak.latency_drift(rows))
        self.assertTrue(ok, detail)
        # where most of its minutes are more than 20% from the first one
        within, total = map(int, soak.minutes_vs_first(rows)["ttft_p99"].split(" of "))
        self.assertEqual(total, 29)
        self.assertLess(within, total / 2)

    def test_a_slow_climb_fails_and_names_the_latency(self):
        # The same noise on a latency that grows by 2% a minute (+58% by the end).
        rows = run([v * (1 + 0.02 * m) for m, v in enumerate(NOISY)])
        ok, detail = soak.steady(soak.latency_drift(rows))
        self.assertFalse(ok)
        self.assertIn("ttft_p99", detail)
        self.assertNotIn("itl_p50", detail)

    def test_a_step_in_the_middle_fails(self):
        # 30% slower from minute 15 on, as after a leak that starts to swap or a cache that stops
        # hitting.
        rows = run(NOISY, itl_p50=[0.02 if m < 15 else 0.026 for m in range(30)])
        ok, detail = soak.steady(soak.latency_drift(rows))
        self.assertFalse(ok)
        self.assertIn("itl_p50", detail)

    def test_getting_faster_by_more_than_a_fifth_is_a_drift_too(self):
        rows = run([v * (1 - 0.015 * m) for m, v in enumerate(NOISY)])
        ok, detail = soak.steady(soak.latency_drift(rows))
        self.assertFalse(ok, detail)

    def test_a_few_milliseconds_are_within_the_floor(self):
        # ITL p50 from 3 ms to 4.5 ms: +50%, but within 5 ms.
        rows = run(NOISY, itl_p50=[0.003 + 0.0015 * m / 29 for m in range(30)])
        ok, detail = soak.steady(soak.latency_drift(rows))
        self.assertTrue(ok, detail)

    def test_the_first_minute_is_warm_up(self):
        # A first minute far from the rest (an empty queue) does not set the reference.
        rows = run([0.1] + NOISY[1:])
        ok, detail = soak.steady(soak.latency_drift(rows))
        self.assertTrue(ok, detail)

    def test_a_short_run_is_not_judged(self):
        self.assertIsNone(soak.steady(soak.latency_drift(run(NOISY[:6]))))
        self.assertIsNotNone(soak.steady(soak.latency_drift(run(NOISY[:7]))))


class StepTime(unittest.TestCase):
    def minutes(self, step_ms):
        return [{"minute": m, "step_ms_per_1k_tokens": v} for m, v in enumerate(step_ms)]

    def test_a_step_up_in_the_middle_shows_in_the_thirds(self):
        # the machine's minute-to-minute noise, then 15% more step time per token from minute 15
        noise = [1 + 0.04 * ((m * 7) % 5 - 2) / 2 for m in range(30)]
        drift = soak.step_time_drift(self.minutes([3.0 * n * (1.15 if m >= 15 else 1) for m, n in enumerate(noise)]))
        self.assertEqual(drift["ratio"], 1.15)
        self.assertEqual(soak.step_time_drift(self.minutes([3.0 * n for n in noise]))["ratio"], 1.0)

    def test_none_when_short_or_without_the_metric(self):
        self.assertIsNone(soak.step_time_drift(self.minutes([3.0] * 6)))
        self.assertIsNone(soak.step_time_drift([{"minute": m} for m in range(30)]))

    def test_the_step_time_per_token_of_a_minute(self):
        # (minute, rss, prefix, pool, heap, free, tokens, step seconds) at minutes 0 and 1
        memory = [(0.0, 1, 0, 0, 0, 0, 1000, 2.0), (1.0, 1, 0, 0, 0, 0, 31000, 32.0)]
        cpu = [(0, 0, 100, 0.0, 0.0, 0), (90, 1, 200, 50.0, 1.0, 0)]
        row = soak.cpu_rows(cpu, memory)[0]
        self.assertEqual(row["step_ms_per_1k_tokens"], 1000.0)
        self.assertEqual(row["engine_busy"], 0.5)
        self.assertEqual(row["tokens_per_cpu_s"], 600.0)


class StealCorrelation(unittest.TestCase):
    def test_latency_that_follows_the_stolen_cpu_correlates(self):
        steal = [0.02, 0.01, 0.05, 0.0, 0.03, 0.01, 0.04, 0.02]
        rows = [{"minute": m, "steal": s, "ttft_p50": 0.01 + s, "ttft_p99": 0.5 - s, "itl_p50": 0.005,
                 "itl_p99": [0.1, 0.3, 0.2, 0.1, 0.3, 0.2, 0.1, 0.3][m]} for m, s in enumerate(steal)]
        got = soak.machine_vs_latency(rows, "steal")
        self.assertEqual(got["ttft_p50"], 1.0)
        self.assertEqual(got["ttft_p99"], -1.0)
        self.assertIsNone(got["itl_p50"], "a constant latency has no correlation")
        self.assertLess(abs(got["itl_p99"]), 0.5)


class Verdict(unittest.TestCase):
    """The soak's checks read with the probe's answer (bench/soak_verdict.py)."""

    @staticmethod
    def report(latency_ok, **others):
        checks = {"no 5xx": {"pass": True, "detail": "0 5xx"},
                  "latency steady": {"pass": latency_ok, "detail": "ttft_p50 14.0 ms vs 19.7 ms (0.71x)"}}
        checks.update({k: {"pass": v, "detail": k} for k, v in others.items()})
        return {"checks": checks}

    @staticmethod
    def probe(ratio, errors=0, saturated=1.0, ttft_p99=1.0):
        fresh = {"ttft_p50": 0.020, "ttft_p99": 0.600, "itl_p50": 0.006, "itl_p99": 0.090}
        soaked = {k: v * ratio for k, v in fresh.items()}
        soaked["ttft_p99"] *= ttft_p99
        ratios, ok, _ = soak_probe.compare(soaked, fresh)
        return {"latency": ratios, "pass": ok and not errors, "5xx_or_client_errors": {"soaked": errors, "fresh": 0},
                "saturated": {"time_ratio": saturated}}

    def test_a_drift_of_the_thirds_the_soaked_server_does_not_show_against_a_fresh_one_is_the_machines(self):
        checks = soak_verdict.verdict(self.report(False), self.probe(1.05))
        self.assertTrue(checks["latency steady"][0], checks["latency steady"][1])
        self.assertIn("the machine's", checks["latency steady"][1])
        self.assertIn("0.71x", checks["latency steady"][1], "the thirds' figures stay in the detail")
        checks = soak_verdict.verdict(self.report(False), self.probe(1.05, saturated=1.08, ttft_p99=0.56))
        self.assertTrue(checks["latency steady"][0], "the probe's TTFT p99 is its noise, not judged")

    def test_a_soaked_server_slower_than_a_fresh_one_fails(self):
        for probe in (self.probe(1.3), self.probe(0.7), self.probe(1.0, errors=2), self.probe(1.0, saturated=1.15),
                      self.probe(1.0, saturated=0.85), {"latency": {}, "saturated": None}):
            passed, detail = soak_verdict.verdict(self.report(False), probe)["latency steady"]
            self.assertFalse(passed, detail)

    def test_without_a_probe_the_thirds_decide(self):
        self.assertFalse(soak_verdict.verdict(self.report(False))["latency steady"][0])
        self.assertTrue(soak_verdict.verdict(self.report(True))["latency steady"][0])

    def test_the_probe_judges_latency_alone(self):
        checks = soak_verdict.verdict(self.report(False, **{"counters agree": False}), self.probe(1.0))
        self.assertFalse(checks["counters agree"][0], "a miscount is not the machine's")
        self.assertTrue(checks["no 5xx"][0])
        checks = soak_verdict.verdict(self.report(True), self.probe(1.5))
        self.assertTrue(checks["latency steady"][0], "the thirds passed: the probe is reported, not judged")

    def test_a_file_that_is_not_a_json_object_is_refused_by_name(self):
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            f.write("[1]")
            f.flush()
            with self.assertRaises(SystemExit) as e:
                soak_verdict.load(f.name)
            self.assertIn(f.name, str(e.exception))
            self.assertIn("not a JSON object", str(e.exception))


class Probe(unittest.TestCase):
    def test_each_server_gets_every_request_of_the_minute_once_a_minute(self):
        plan = soak.arrivals(random.Random(3), 30.0, ["Scene I.\n"], 60.0)
        cut = soak_probe.windows(plan, 10.0)
        self.assertEqual(len(cut), 6)
        self.assertEqual([a for w in cut for a in w], plan, "every arrival, in order, once")
        for w, chunk in enumerate(cut):
            self.assertTrue(all(w * 10.0 <= offset < (w + 1) * 10.0 for offset, _ in chunk))
        self.assertEqual(len(soak_probe.windows(plan, 25.0)), 3, "a last, shorter window")
        order = soak_probe.schedule(3, 6)
        self.assertEqual(len(order), 36)
        for i in (0, 1):
            self.assertEqual(sorted((m, w) for s, m, w in order if s == i),
                             [(m, w) for m in range(3) for w in range(6)], "every window of every minute, once")
        self.assertTrue(all(a[0] != b[0] for a, b in zip(order, order[1:])),
                        "no server runs twice in a row: each run follows one of the other's")
        for k, (i, m, w) in enumerate(order):
            if i == 1:
                self.assertEqual(order[k - 1], (0, m, w), "the same window, to server 0 and then to server 1")

    def test_judged_each_latency_within_20_percent_or_5_ms(self):
        fresh = {"ttft_p50": 0.020, "ttft_p99": 0.600, "itl_p50": 0.006, "itl_p99": 0.090}
        ok = {"ttft_p50": 0.024, "ttft_p99": 0.500, "itl_p50": 0.010, "itl_p99": 0.107}
        ratios, passed, detail = soak_probe.compare(ok, fresh)
        self.assertTrue(passed, detail)
        self.assertEqual(ratios["ttft_p50"]["ratio"], 1.2)
        slow = dict(ok, ttft_p99=0.800)
        _, passed, detail = soak_probe.compare(slow, fresh)
        self.assertFalse(passed)
        self.assertIn("ttft_p99", detail)
        _, passed, _ = soak_probe.compare(dict(ok, ttft_p99=0.400), fresh)
        self.assertFalse(passed, "faster by more than 20% is a drift too")
        _, passed, detail = soak_probe.compare(dict(ok, itl_p99=None), fresh)
        self.assertFalse(passed, "a server that streamed nothing")
        self.assertIn("no streams", detail)

    def test_work_per_token_between_two_readings(self):
        self.assertEqual(soak_probe.per_token((10.0, 1000, 1.5), (13.0, 3000, 2.5)),
                         {"tokens": 2000, "cpu_s": 3.0, "cpu_ms_per_1k_tokens": 1500.0,
                          "step_s": 1.0, "step_ms_per_1k_tokens": 500.0})
        self.assertEqual(soak_probe.per_token((None, 1000, 1.5), (None, 3000, 2.5))["cpu_ms_per_1k_tokens"], None,
                         "a process not found: the step time alone")
        self.assertIsNone(soak_probe.per_token(None, (13.0, 3000, 2.5)), "a server not answering")
        self.assertIsNone(soak_probe.per_token((10.0, 1000, 1.5), (11.0, 1000, 1.5)), "no tokens processed")

    def test_the_process_listening_on_a_port_is_found(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            if not os.path.exists("/proc/net/tcp"):
                self.skipTest("no /proc/net/tcp")
            self.assertEqual(soak_probe.listening_pid(f"http://127.0.0.1:{port}"), os.getpid())
        self.assertIsNone(soak_probe.listening_pid(f"http://127.0.0.1:{port}"), "nobody listens now")

    def test_saturated_sends_each_request_once_with_many_clients_at_once(self):
        seen, lock, at_once = [], threading.Lock(), [0, 0]  # [now, most]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with lock:
                    seen.append(body["prompt"])
                    at_once[0] += 1
                    at_once[1] = max(at_once)
                threading.Event().wait(0.02)
                with lock:
                    at_once[0] -= 1
                fail = body["prompt"] == "p7"
                out = json.dumps({"error": "x"} if fail else {"usage": {"completion_tokens": 1}}).encode()
                self.send_response(500 if fail else 200)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            work = [("/v1/completions", {"prompt": f"p{i}", "max_tokens": 1}, False, False) for i in range(40)]
            seconds, bad = soak_probe.saturated(f"http://127.0.0.1:{server.server_address[1]}", work, None, 8)
        finally:
            server.shutdown()
        self.assertEqual(sorted(seen), sorted(f"p{i}" for i in range(40)), "every request, once")
        self.assertEqual(bad, 1, "the one 500")
        self.assertGreater(at_once[1], 1, "clients in parallel")
        self.assertLessEqual(at_once[1], 8, "no more than the clients")
        self.assertGreater(seconds, 0.02 * 40 / 8 * 0.9)


if __name__ == "__main__":
    unittest.main()

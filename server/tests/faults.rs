//! gpt-server under faults, each test asserting what the client sees and what is left: clients
//! that stop reading their streams, idle and slow connections, the request timeout, an engine
//! thread that panics or whose steps fail, SIGTERM with 64 streams in flight, and the API key on
//! every route that reads the model.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::json;

/// gpt-server on `checkpoint` with `extra` flags and `env`, on an ephemeral port.
fn spawn(checkpoint: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(Child, String)> {
    let (child, url, _log) = common::spawn_binary(checkpoint, extra, env)?;
    Ok((child, url))
}

fn wait_exit(child: &mut Child, within: Duration) -> anyhow::Result<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill()?;
    anyhow::bail!("the server did not exit within {within:?}")
}

/// A counter's value in `/metrics`.
async fn metric(url: &str, name: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!("{url}/metrics")).await?.text().await?;
    Ok(text
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0))
}

/// A TCP connection to `addr` with a tiny receive buffer (set before it connects, so that the
/// window stays small): a client that stops reading makes the server's writes back up at once.
fn small_window_connection(addr: &str) -> anyhow::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let addr: std::net::SocketAddrV4 = addr.trim_start_matches("http://").parse()?;
    // SAFETY: a fresh socket, configured and connected through libc with valid arguments; its
    // descriptor is handed to the TcpStream, which owns and closes it.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let size: libc::c_int = 2048;
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            &size as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: addr.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*addr.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let rc = libc::connect(
            fd,
            &sin as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            anyhow::bail!("connect: {e}");
        }
        Ok(TcpStream::from_raw_fd(fd))
    }
}

fn post_raw(stream: &mut TcpStream, path: &str, body: &serde_json::Value) -> anyhow::Result<()> {
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    Ok(())
}

#[tokio::test]
async fn streams_whose_clients_stop_reading_are_dropped_and_others_are_served() -> anyhow::Result<()> {
    // A small, fast model with a long context and a 64 KiB send buffer per connection: a
    // stream's output (each chunk with 20 alternatives, ~1.3 kB) outgrows what the kernel
    // buffers, so a client that reads nothing soon holds its sequence paused.
    let dir = common::random_checkpoint(gpt::Config {
        n_positions: 4096,
        n_embd: 64,
        n_layer: 2,
        n_head: 2,
        ..gpt::Config::tiny(320)
    })?;
    let (mut child, url) = spawn(
        dir.path(),
        &[
            "--stream-timeout-secs",
            "2",
            "--max-tokens-cap",
            "4000",
            "--send-buffer-kib",
            "64",
        ],
        &[],
    )?;
    let body = json!({"prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": true, "logprobs": 20});
    const SILENT: usize = 50;
    let mut silent = Vec::new();
    for _ in 0..SILENT {
        let mut stream = small_window_connection(&url)?;
        post_raw(&mut stream, "/v1/completions", &body)?;
        silent.push(stream);
    }
    // Meanwhile another client is served as usual.
    let client = reqwest::Client::new();
    let start = Instant::now();
    let answer: serde_json::Value = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "hello", "max_tokens": 3, "temperature": 0}))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
    // Every silent stream is dropped once its timeout has passed, and its sequence freed.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let dropped = metric(&url, "gpt_stream_timeouts_total").await?;
        if dropped >= SILENT as f64 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{dropped} of {SILENT} silent streams dropped after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(metric(&url, "gpt_queue_depth").await?, 0.0);
    // The engine is idle again: a request is answered at once.
    let again = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "hello", "max_tokens": 3, "temperature": 0}))
        .send()
        .await?;
    assert_eq!(again.status(), 200);
    println!("served beside {SILENT} silent streams in {:?}", start.elapsed());
    child.kill()?;
    child.wait()?;
    Ok(())
}

#[tokio::test]
async fn idle_and_slow_connections_do_not_stop_the_others() -> anyhow::Result<()> {
    let (mut child, url) = spawn(&common::fixture(), &["--header-timeout-secs", "2"], &[])?;
    let addr = url.trim_start_matches("http://").to_string();
    // 1000 idle connections: one request each, then kept alive with nothing more.
    let mut idle = Vec::new();
    for i in 0..1000 {
        let mut stream = TcpStream::connect(&addr)?;
        if i % 10 == 0 {
            write!(stream, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")?;
        }
        idle.push(stream);
    }
    // Clients that send their headers a byte at a time, too slowly.
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut stream = TcpStream::connect(&addr)?;
        stream.write_all(b"P")?;
        slow.push(stream);
    }
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let start = Instant::now();
        let answer = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": "hello", "max_tokens": 5}))
            .send()
            .await?;
        assert_eq!(answer.status(), 200);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "answered in {:?}",
            start.elapsed()
        );
        for stream in &mut slow {
            let _ = stream.write_all(b"O");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The slow clients' headers never completed: past the header timeout, their connections are
    // closed by the server.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for stream in &mut slow {
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut buf = [0u8; 256];
        let closed = match stream.read(&mut buf) {
            Ok(0) => true,
            Ok(_) => true, // an error response, then the close
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "a slow client's connection is still open");
    }
    drop(idle);
    child.kill()?;
    child.wait()?;
    Ok(())
}

#[tokio::test]
async fn a_request_past_the_time_limit_ends_and_frees_its_sequence() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    let (mut child, url) = spawn(slow.path(), &["--request-timeout-secs", "1"], &[])?;
    let client = reqwest::Client::new();
    let body = json!({"prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let text = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await?
        .text()
        .await?;
    assert!(
        text.contains("\"finish_reason\":\"length\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .map(|c| c["usage"]["completion_tokens"].as_u64().unwrap_or(1000))
        .unwrap_or(1000);
    assert!(usage < 1000, "not cut by the time limit: {usage} tokens");
    let whole = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 1000, "temperature": 0}))
        .send()
        .await?;
    assert_eq!(whole.status(), 504);
    let error: serde_json::Value = whole.json().await?;
    assert_eq!(error["error"]["code"], "timeout", "{error}");
    assert_eq!(metric(&url, "gpt_request_timeouts_total").await?, 2.0);
    assert_eq!(metric(&url, "gpt_queue_depth").await?, 0.0);
    child.kill()?;
    child.wait()?;
    Ok(())
}

#[tokio::test]
async fn an_engine_that_fails_fails_its_requests_turns_unhealthy_and_exits() -> anyhow::Result<()> {
    for fault in ["panic", "fail-steps"] {
        let (mut child, url) = spawn(&common::fixture(), &[], &[("GPT_SERVER_FAULT", fault)])?;
        let client = reqwest::Client::new();
        let streamed = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": "hello", "max_tokens": 5, "stream": true}))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .text()
            .await?;
        assert!(
            streamed.contains("event: error") && streamed.trim_end().ends_with("data: [DONE]"),
            "{fault}: {streamed}"
        );
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let whole = client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": "hello", "max_tokens": 5}))
                .timeout(Duration::from_secs(10))
                .send()
                .await;
            match whole {
                Ok(r) => {
                    statuses.push(r.status().as_u16());
                    let body: serde_json::Value = r.json().await.unwrap_or_default();
                    assert!(body["error"]["message"].is_string(), "{fault}: {body}");
                }
                Err(_) => break, // the process has exited
            }
        }
        assert!(
            statuses.iter().all(|&s| s == 500 || s == 503),
            "{fault}: statuses {statuses:?}"
        );
        let status = wait_exit(&mut child, Duration::from_secs(10))?;
        assert!(!status.success(), "{fault}: exited with {status}");
    }
    Ok(())
}

#[tokio::test]
async fn sigterm_with_64_streams_ends_each_with_a_final_chunk_and_exits_in_time() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    let (mut child, url) = spawn(slow.path(), &["--shutdown-grace-secs", "2"], &[])?;
    let client = reqwest::Client::new();
    let mut streams = Vec::new();
    for _ in 0..64 {
        let client = client.clone();
        let url = url.clone();
        streams.push(tokio::spawn(async move {
            let body = json!({"prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": true});
            let response = client.post(format!("{url}/v1/completions")).json(&body).send().await?;
            anyhow::Ok(response.text().await?)
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let signalled = Instant::now();
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status()?;
    for stream in streams {
        let text = stream.await??;
        assert!(
            text.contains("\"finish_reason\":\"length\"") && text.trim_end().ends_with("data: [DONE]"),
            "a stream without its final chunk: {text}"
        );
    }
    let status = wait_exit(&mut child, Duration::from_secs(4))?;
    assert_eq!(status.code(), Some(0));
    assert!(
        signalled.elapsed() <= Duration::from_secs(3),
        "exited {:?} after SIGTERM (grace 2 s)",
        signalled.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn the_api_key_guards_every_route_that_reads_the_model() -> anyhow::Result<()> {
    let (mut child, url) = spawn(&common::fixture(), &["--api-key", "k", "--metrics-key", "m"], &[])?;
    let client = reqwest::Client::new();
    let routes = [
        ("POST", "/v1/completions", json!({"prompt": "hi", "max_tokens": 1})),
        (
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ),
        ("POST", "/v1/attention", json!({"prompt": "hi"})),
        ("GET", "/v1/models", json!(null)),
        ("POST", "/tokenize", json!({"prompt": "hi"})),
        ("POST", "/detokenize", json!({"tokens": [1]})),
        ("GET", "/tokenizer_info", json!(null)),
    ];
    for (method, path, body) in &routes {
        for (key, want) in [(None, 401), (Some("wrong"), 401), (Some("k"), 200)] {
            let mut request = match *method {
                "GET" => client.get(format!("{url}{path}")),
                _ => client.post(format!("{url}{path}")).json(body),
            };
            if let Some(key) = key {
                request = request.bearer_auth(key);
            }
            let status = request.send().await?.status().as_u16();
            assert_eq!(status, want, "{method} {path} with key {key:?}");
        }
    }
    assert_eq!(
        reqwest::get(format!("{url}/health")).await?.status(),
        200,
        "/health is open"
    );
    assert_eq!(reqwest::get(format!("{url}/metrics")).await?.status(), 401);
    let metrics = client.get(format!("{url}/metrics")).bearer_auth("m").send().await?;
    assert_eq!(metrics.status(), 200);
    child.kill()?;
    child.wait()?;
    Ok(())
}

//! A stand-in for the Hugging Face Hub's file endpoints, for tests: enough of them for the
//! `hf-hub` crate and for Python's `huggingface_hub` (`snapshot_download`, `hf_hub_download`).
//! Std only (a thread per connection, `Connection: close`).
//!
//! Routes, as the Hub answers them:
//! - `GET /api/{models,datasets}/REPO[/revision/REV]`: the repository's commit (`sha`) and files
//!   (`siblings`);
//! - `GET /api/{models,datasets}/REPO/tree/REV[?recursive=...]`: the files with sizes and ids;
//! - `HEAD` and `GET /[datasets/]REPO/resolve/REV/FILE`: the file, with `ETag`, `X-Repo-Commit`,
//!   `Content-Length` and `Accept-Ranges`; a `Range: bytes=A-[B]` request gets `206` and
//!   `Content-Range`.
//!
//! An unknown repository or revision is a 404 (`X-Error-Code: RepoNotFound` /
//! `RevisionNotFound`); a gated repository without its token a 401 (`GatedRepo`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One repository at one commit.
#[derive(Clone)]
pub struct FakeRepo {
    /// `org/name` or `name`.
    pub id: String,
    pub dataset: bool,
    /// 40 hex digits.
    pub commit: String,
    pub files: Vec<(String, Vec<u8>)>,
    /// Requests must carry `Authorization: Bearer TOKEN`.
    pub token: Option<String>,
    /// A file whose downloads break off halfway (its size announced whole).
    pub broken: Option<String>,
}

impl FakeRepo {
    pub fn model(id: &str, files: Vec<(String, Vec<u8>)>) -> Self {
        Self {
            id: id.to_string(),
            dataset: false,
            commit: hex40(id.as_bytes()),
            files,
            token: None,
            broken: None,
        }
    }

    /// The files of a directory (not recursive), under their names.
    pub fn from_dir(id: &str, dir: &std::path::Path) -> std::io::Result<Self> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_file() {
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                files.push((name, std::fs::read(&path)?));
            }
        }
        files.sort();
        Ok(Self::model(id, files))
    }
}

pub struct FakeHub {
    /// `http://127.0.0.1:PORT`, for `HF_ENDPOINT`.
    pub url: String,
    requests: Arc<AtomicUsize>,
}

impl FakeHub {
    pub fn start(repos: Vec<FakeRepo>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake Hub");
        let url = format!("http://{}", listener.local_addr().expect("its address"));
        let requests = Arc::new(AtomicUsize::new(0));
        let (repos, count) = (Arc::new(repos), requests.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repos, count) = (repos.clone(), count.clone());
                std::thread::spawn(move || {
                    count.fetch_add(1, Ordering::SeqCst);
                    let _ = serve(stream, &repos);
                });
            }
        });
        Self { url, requests }
    }

    /// Requests answered so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// 40 hex digits from bytes (FNV-1a, five rounds): a commit or an ETag that changes with them.
pub fn hex40(bytes: &[u8]) -> String {
    (0..5u64)
        .map(|round| {
            let mut h = 0xcbf2_9ce4_8422_2325u64 ^ round;
            for &b in bytes {
                h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
            }
            format!("{:08x}", (h >> 32) as u32 ^ h as u32)
        })
        .collect()
}

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn read_request(stream: &TcpStream) -> std::io::Result<Request> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("/").to_string(),
    );
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.push((n.trim().to_string(), v.trim().to_string()));
        }
    }
    let length: usize = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let path = target.split('?').next().unwrap_or("/").to_string();
    Ok(Request {
        method,
        path: percent_decode(&path),
        headers,
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(
    mut stream: &TcpStream,
    status: u16,
    headers: &[(&str, String)],
    body: &[u8],
    head: bool,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        206 => "Partial Content",
        401 => "Unauthorized",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Error",
    };
    let mut out = format!("HTTP/1.1 {status} {reason}\r\nConnection: close\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("content-length")) {
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    stream.write_all(out.as_bytes())?;
    if !head {
        stream.write_all(body)?;
    }
    stream.flush()
}

fn error(stream: &TcpStream, status: u16, code: &str, message: &str, head: bool) -> std::io::Result<()> {
    let body = format!("{{\"error\": \"{message}\"}}");
    respond(
        stream,
        status,
        &[
            ("Content-Type", "application/json".into()),
            ("X-Error-Code", code.into()),
            ("X-Error-Message", message.into()),
        ],
        body.as_bytes(),
        head,
    )
}

/// The repository a path names after its type prefix, and the rest of the path.
fn find_repo<'a>(repos: &'a [FakeRepo], rest: &str, dataset: bool, split: &str) -> Option<(&'a FakeRepo, String)> {
    repos.iter().filter(|r| r.dataset == dataset).find_map(|r| {
        let tail = rest.strip_prefix(&r.id)?;
        if tail.is_empty() && split.is_empty() {
            return Some((r, String::new()));
        }
        Some((r, tail.strip_prefix(split)?.to_string()))
    })
}

fn serve(stream: TcpStream, repos: &[FakeRepo]) -> std::io::Result<()> {
    let req = read_request(&stream)?;
    let head = req.method == "HEAD";
    let path = req.path.trim_start_matches('/');
    let authorized = |repo: &FakeRepo| match &repo.token {
        None => true,
        Some(token) => req.header("authorization") == Some(&format!("Bearer {token}")),
    };
    let revision_ok = |repo: &FakeRepo, rev: &str| rev == "main" || rev == repo.commit;
    if let Some(api) = path.strip_prefix("api/") {
        let (dataset, rest) = match (api.strip_prefix("models/"), api.strip_prefix("datasets/")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) => (true, rest),
            _ => return error(&stream, 404, "EntryNotFound", "no such route", head),
        };
        // `REPO`, `REPO/revision/REV` or `REPO/tree/REV[/...]`.
        let found = find_repo(repos, rest, dataset, "/revision/")
            .map(|(r, rev)| (r, rev, false))
            .or_else(|| find_repo(repos, rest, dataset, "/tree/").map(|(r, rev)| (r, rev, true)))
            .or_else(|| find_repo(repos, rest, dataset, "").map(|(r, _)| (r, "main".to_string(), false)));
        let Some((repo, rev, tree)) = found else {
            return error(&stream, 404, "RepoNotFound", "Repository not found", head);
        };
        if !authorized(repo) {
            return error(
                &stream,
                401,
                "GatedRepo",
                "Access to this repository is restricted",
                head,
            );
        }
        let rev = rev.split('/').next().unwrap_or("main");
        if !revision_ok(repo, rev) {
            return error(&stream, 404, "RevisionNotFound", "Invalid rev id", head);
        }
        let body = if tree {
            let entries: Vec<serde_json::Value> = repo
                .files
                .iter()
                .map(|(name, data)| {
                    serde_json::json!({"type": "file", "path": name, "size": data.len(), "oid": hex40(data)})
                })
                .collect();
            serde_json::Value::from(entries)
        } else {
            let siblings: Vec<serde_json::Value> = repo
                .files
                .iter()
                .map(|(name, _)| serde_json::json!({"rfilename": name}))
                .collect();
            serde_json::json!({
                "_id": repo.commit, "id": repo.id, "modelId": repo.id, "sha": repo.commit,
                "siblings": siblings, "private": repo.token.is_some(), "gated": false, "disabled": false,
                "lastModified": "2026-01-01T00:00:00.000Z", "tags": [], "downloads": 0, "likes": 0,
            })
        };
        return respond(
            &stream,
            200,
            &[("Content-Type", "application/json".into())],
            body.to_string().as_bytes(),
            head,
        );
    }
    let (dataset, rest) = match path.strip_prefix("datasets/") {
        Some(rest) => (true, rest),
        None => (false, path),
    };
    let Some((repo, tail)) = find_repo(repos, rest, dataset, "/resolve/") else {
        return error(&stream, 404, "RepoNotFound", "Repository not found", head);
    };
    if !authorized(repo) {
        return error(
            &stream,
            401,
            "GatedRepo",
            "Access to this repository is restricted",
            head,
        );
    }
    let (rev, file) = tail.split_once('/').unwrap_or((tail.as_str(), ""));
    if !revision_ok(repo, rev) {
        return error(&stream, 404, "RevisionNotFound", "Invalid rev id", head);
    }
    let Some((_, data)) = repo.files.iter().find(|(name, _)| name == file) else {
        return error(&stream, 404, "EntryNotFound", "Entry not found", head);
    };
    let mut headers = vec![
        ("Content-Type", "application/octet-stream".to_string()),
        ("ETag", format!("\"{}\"", hex40(data))),
        ("X-Repo-Commit", repo.commit.clone()),
        ("Accept-Ranges", "bytes".into()),
    ];
    let range = req
        .header("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| {
            let (a, b) = r.split_once('-')?;
            let a: usize = a.parse().ok()?;
            let b: usize = if b.is_empty() {
                data.len().saturating_sub(1)
            } else {
                b.parse().ok()?
            };
            Some((a, b.min(data.len().saturating_sub(1))))
        });
    match range {
        Some((a, b)) if a <= b && b < data.len() => {
            headers.push(("Content-Range", format!("bytes {a}-{b}/{}", data.len())));
            if repo.broken.as_deref() == Some(file) && b > a {
                headers.push(("Content-Length", format!("{}", b + 1 - a)));
                return respond(&stream, 206, &headers, &data[a..a + (b - a) / 2], head);
            }
            respond(&stream, 206, &headers, &data[a..=b], head)
        }
        Some(_) => {
            headers.push(("Content-Range", format!("bytes */{}", data.len())));
            respond(&stream, 416, &headers, b"", head)
        }
        None if repo.broken.as_deref() == Some(file) => {
            headers.push(("Content-Length", format!("{}", data.len())));
            respond(&stream, 200, &headers, &data[..data.len() / 2], head)
        }
        None => respond(&stream, 200, &headers, data, head),
    }
}

//! Accepting connections. `axum::serve` runs each connection without a timer, so a client that
//! sends its headers one byte at a time holds a connection (and a task) forever, and it accepts
//! connections without bound. Here, as in `axum::serve` otherwise (hyper's automatic HTTP/1 and
//! HTTP/2, graceful shutdown): each connection reads its request headers within
//! `header_read_timeout` or is closed, at most `max_connections` are served at once (further
//! ones wait in the listen backlog), and the process's open-file limit is raised to its hard
//! limit so that the connection limit, not the file limit, is what binds.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Debug, Clone, Copy)]
pub struct ServeConfig {
    /// A connection whose client has not sent a whole request head within this is closed.
    pub header_read_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// Each connection's kernel send buffer in bytes (`SO_SNDBUF`); `None` leaves the kernel's
    /// autotuning (up to `net.ipv4.tcp_wmem`'s maximum, 4 MB by default).
    pub send_buffer: Option<usize>,
}

/// Sets a socket's kernel send buffer. (tokio sets it only on sockets it connects itself, and
/// socket2 would be a dependency for one call.)
#[cfg(unix)]
fn set_send_buffer(stream: &tokio::net::TcpStream, bytes: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let size = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid descriptor owned by `stream`, and a pointer to a c_int with its size.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &size as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(unix))]
fn set_send_buffer(_: &tokio::net::TcpStream, _: usize) -> std::io::Result<()> {
    Ok(())
}

/// Raises the soft limit on open files to the hard one (each connection is a file); returns the
/// limit now in force.
pub fn raise_open_files_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit on RLIMIT_NOFILE with a valid struct; no memory is shared.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 0;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                ..limit
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return raised.rlim_cur;
            }
        }
        limit.rlim_cur
    }
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish its requests (closing idle keep-alive ones), and returns once all are closed.
pub async fn serve(listener: TcpListener, app: Router, cfg: ServeConfig, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(cfg.max_connections.max(1)));
    let mut shutdown = std::pin::pin!(shutdown);
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break, // never closed
            },
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of files or buffers: wait a little rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        if let Some(bytes) = cfg.send_buffer {
            if let Err(e) = set_send_buffer(&stream, bytes) {
                tracing::warn!(error = %e, bytes, "setting the send buffer failed");
            }
        }
        tracing::trace!(%peer, "connection accepted");
        let service = TowerToHyperService::new(
            app.clone()
                .map_request(|request: Request<Incoming>| request.map(Body::new)),
        );
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::trace!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

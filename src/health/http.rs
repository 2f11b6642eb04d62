//! A small HTTP/1 server with limits, so a slow or hostile client cannot exhaust it: request
//! headers must arrive within [`Limits::header_timeout`] and fit in [`Limits::max_header_bytes`],
//! a connection lives at most [`Limits::connection_timeout`], bodies are never read, and at most
//! [`Limits::max_connections`] connections are served at once (more are closed at accept).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::debug;

/// Server limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    pub max_header_bytes: usize,
    pub connection_timeout: Duration,
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(5),
            max_header_bytes: 16 * 1024,
            connection_timeout: Duration::from_secs(30),
            max_connections: 128,
        }
    }
}

/// A response: status, content type, body.
pub struct Reply {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Reply {
    /// A JSON reply with upstream's headers.
    pub fn json(status: StatusCode, body: String) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            headers: vec![("X-Content-Type-Options", "nosniff".into())],
            body,
        }
    }

    /// A plain-text reply.
    pub fn text(status: StatusCode, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: vec![("X-Content-Type-Options", "nosniff".into())],
            body: body.into(),
        }
    }
}

/// Handles one request (method and path; bodies are ignored).
pub type Handler = Arc<dyn Fn(&str, &str) -> Reply + Send + Sync>;

fn respond(reply: Reply) -> Response<Full<Bytes>> {
    let mut builder = Response::builder().status(reply.status).header("Content-Type", reply.content_type);
    for (k, v) in reply.headers {
        builder = builder.header(k, v);
    }
    builder.body(Full::new(Bytes::from(reply.body))).unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

/// Serves `listener` until `shutdown` turns true.
pub async fn serve(listener: TcpListener, handler: Handler, limits: Limits, mut shutdown: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => return,
        };
        let Ok((stream, peer)) = accepted else { continue };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            debug!(%peer, "too many connections; closing");
            continue;
        };
        let handler = Arc::clone(&handler);
        let mut conn_shutdown = shutdown.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let reply = handler(req.method().as_str(), req.uri().path());
                async move { Ok::<_, Infallible>(respond(reply)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(limits.max_header_bytes.max(8192))
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = tokio::time::timeout(limits.connection_timeout, conn) => {}
                _ = conn_shutdown.changed() => {}
            }
        });
    }
}

/// Binds `addr` (std, so errors surface at once) and converts it for tokio.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

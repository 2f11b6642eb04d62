//! A small HTTP/1 server with limits, so a slow or hostile client cannot exhaust it: request
//! headers must arrive within [`Limits::header_timeout`] and fit in [`Limits::max_header_bytes`],
//! a connection lives at most [`Limits::connection_timeout`], bodies are never read, and at most
//! [`Limits::max_connections`] connections are served at once (more are closed at accept).
//!
//! It listens only on the address it is given (see [`bind`]). The health, metrics and debug
//! servers and the health-check node ports all run on it, each with its own [`Handler`].

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
use tokio::runtime::Handle;
use tokio::sync::{Semaphore, watch};
use tracing::{debug, error, info, warn};

/// hyper's smallest read buffer; [`Limits::max_header_bytes`] is enforced separately below it.
const MIN_BUFFER: usize = 8192;

/// How long to pause after a failed accept (typically out of file descriptors, which an accept
/// loop would otherwise hit again at once, spinning a core).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Server limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Time to send a request's start line and headers, from the connection's opening or the
    /// previous response (so it also ends idle keep-alive connections).
    pub header_timeout: Duration,
    /// Largest start line plus headers; larger requests get 431 and the connection is closed.
    pub max_header_bytes: usize,
    /// Longest life of a connection, however it is used.
    pub connection_timeout: Duration,
    /// Connections served at once; connections beyond are closed as soon as they are accepted.
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
pub(crate) struct Reply {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Reply {
    /// A JSON reply with upstream's headers.
    pub(crate) fn json(status: StatusCode, body: String) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            headers: vec![("X-Content-Type-Options", "nosniff".into())],
            body,
        }
    }

    /// A plain-text reply.
    pub(crate) fn text(status: StatusCode, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: vec![("X-Content-Type-Options", "nosniff".into())],
            body: body.into(),
        }
    }
}

/// What a request asks: its method, path, query string (empty when none) and `Accept` header
/// (empty when none); bodies are ignored.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: &'a str,
    pub accept: &'a str,
}

impl<'a> Asked<'a> {
    /// A GET of `path` with `query`, accepting anything.
    #[cfg(test)]
    pub(crate) fn get(path: &'a str, query: &'a str) -> Asked<'a> {
        Asked { method: "GET", path, query, accept: "" }
    }
}

/// Handles one request.
pub(crate) type Handler = Arc<dyn Fn(&Asked<'_>) -> Reply + Send + Sync>;

fn respond(reply: Reply) -> Response<Full<Bytes>> {
    let mut builder = Response::builder().status(reply.status).header("Content-Type", reply.content_type);
    for (k, v) in reply.headers {
        builder = builder.header(k, v);
    }
    builder.body(Full::new(Bytes::from(reply.body))).unwrap_or_else(|e| {
        // Only an invalid header value gets here. Never fall back to an empty 200: a load
        // balancer would read it as healthy.
        warn!(error = %e, "cannot build a response");
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        response
    })
}

/// Serves `listener` until `shutdown` turns true (or its sender is dropped); stopping also ends
/// the open connections.
pub(crate) async fn serve(
    listener: TcpListener,
    handler: Handler,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // hyper's buffer cannot be smaller than 8 KiB, hence the separate header limit.
        .max_header_size(limits.max_header_bytes)
        .max_buf_size(limits.max_header_bytes.max(MIN_BUFFER))
        .keep_alive(true);
    let http = Arc::new(http);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "accept failed; pausing");
                tokio::select! {
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        };
        // Counted from accept to close, so idle and slow connections hold their slot too.
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            debug!(%peer, "too many connections; closing");
            continue;
        };
        let handler = Arc::clone(&handler);
        let http = Arc::clone(&http);
        let mut conn_shutdown = shutdown.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                // The body is dropped unread: hyper then drains what has already arrived and
                // otherwise closes the connection after the response.
                let accept = req.headers().get(hyper::header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
                let asked = Asked {
                    method: req.method().as_str(),
                    path: req.uri().path(),
                    query: req.uri().query().unwrap_or(""),
                    accept,
                };
                let reply = handler(&asked);
                async move { Ok::<_, Infallible>(respond(reply)) }
            });
            let conn = http.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                ended = tokio::time::timeout(limits.connection_timeout, conn) => match ended {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(%peer, error = %e, "connection ended"),
                    Err(_) => debug!(%peer, "connection timeout; closing"),
                },
                _ = conn_shutdown.wait_for(|stop| *stop) => {}
            }
        });
    }
}

/// Binds exactly `addr` (std, so errors surface at once) and makes it ready for tokio.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Starts a server for `handler` on `addr` in the runtime behind `rt`.
pub(crate) fn start(
    rt: &Handle,
    addr: SocketAddr,
    handler: Handler,
    limits: Limits,
) -> std::io::Result<watch::Sender<bool>> {
    start_on(rt, bind(addr)?, handler, limits)
}

/// Serves `handler` on a bound, non-blocking listener in the runtime behind `rt`; the returned
/// switch stops it.
pub(crate) fn start_on(
    rt: &Handle,
    std_listener: std::net::TcpListener,
    handler: Handler,
    limits: Limits,
) -> std::io::Result<watch::Sender<bool>> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let _guard = rt.enter();
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    rt.spawn(serve(listener, handler, limits, stop_rx));
    Ok(stop_tx)
}

/// How often a server whose address cannot be bound tries again (upstream's `wait.Until`
/// period for the healthz and metrics servers).
pub(crate) const BIND_RETRY: Duration = Duration::from_secs(5);

/// Serves `handler` on `addr`, and when the address cannot be bound, logs it and tries again
/// every `retry` until it can (or until the returned switch stops it), as upstream's healthz
/// and metrics servers do without `--bind-address-hard-fail`.
pub(crate) fn start_retrying(
    rt: &Handle,
    what: &'static str,
    addr: SocketAddr,
    handler: Handler,
    limits: Limits,
    retry: Duration,
) -> watch::Sender<bool> {
    let (stop_tx, mut stop_rx) = watch::channel(false);
    rt.spawn(async move {
        loop {
            let bound = bind(addr).and_then(tokio::net::TcpListener::from_std);
            match bound {
                Ok(listener) => {
                    info!(server = what, address = %addr, "serving");
                    serve(listener, handler, limits, stop_rx).await;
                    return;
                }
                Err(e) => error!(
                    server = what, address = %addr, error = %e, retry_in = ?retry,
                    "failed to start the {what} server; retrying"
                ),
            }
            tokio::select! {
                _ = tokio::time::sleep(retry) => {}
                _ = stop_rx.changed() => return,
            }
        }
    });
    stop_tx
}

#[cfg(test)]
pub(crate) mod tests {
    //! The server against real TCP clients on loopback: oversized, slow, idle, too many, and
    //! body-sending clients. Every test is bounded in time and asserts what the client sees.

    use std::io;
    use std::os::fd::AsRawFd;
    use std::time::Instant;

    use nix::errno::Errno;
    use nix::sys::socket::{MsgFlags, recv};
    use tokio::net::TcpStream;
    use tokio::time::{sleep, timeout};

    use super::*;

    /// Upper bound of any one test.
    const TEST_BOUND: Duration = Duration::from_secs(15);
    /// How long a client waits for something the server should do promptly.
    const PROMPT: Duration = Duration::from_secs(2);

    /// Small limits, so tests are fast.
    pub(crate) fn limits() -> Limits {
        Limits {
            header_timeout: Duration::from_millis(300),
            max_header_bytes: 1024,
            connection_timeout: Duration::from_secs(10),
            max_connections: 8,
        }
    }

    /// A running server; stops when dropped.
    struct Server {
        addr: SocketAddr,
        _stop: watch::Sender<bool>,
    }

    fn start(limits: Limits) -> Server {
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
        let addr = listener.local_addr().expect("local address");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        let handler: Handler = Arc::new(|asked| Reply::text(StatusCode::OK, format!("ok {}", asked.path)));
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(serve(listener, handler, limits, stop_rx));
        Server { addr, _stop: stop }
    }

    /// Runs `test`, failing it if it takes longer than [`TEST_BOUND`].
    pub(crate) async fn bounded<F: Future>(test: F) -> F::Output {
        timeout(TEST_BOUND, test).await.expect("test took too long")
    }

    async fn write_all(s: &TcpStream, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            s.writable().await?;
            match s.try_write(data) {
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads until the server closes the connection (EOF or reset); returns what arrived.
    async fn read_until_closed(s: &TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if s.readable().await.is_err() {
                return out;
            }
            match s.try_read(&mut buf) {
                Ok(0) => return out,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return out,
            }
        }
    }

    /// Waits at most `bound` for the server to close `s`; returns what arrived, or None if it
    /// stayed open.
    async fn closed_within(s: &TcpStream, bound: Duration) -> Option<Vec<u8>> {
        timeout(bound, read_until_closed(s)).await.ok()
    }

    /// Whether the server still holds `s` open (asks the kernel directly, without waiting).
    fn still_open(s: &TcpStream) -> bool {
        let mut buf = [0u8; 1];
        matches!(recv(s.as_raw_fd(), &mut buf, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT), Err(Errno::EAGAIN))
    }

    /// The status code of a raw HTTP/1 response.
    fn status(response: &[u8]) -> Option<u16> {
        let text = std::str::from_utf8(response.get(..12)?).ok()?;
        text.strip_prefix("HTTP/1.1 ")?.parse().ok()
    }

    /// Sends `request` on a new connection and returns the whole response (the server closes).
    async fn exchange(addr: SocketAddr, request: &[u8]) -> io::Result<Vec<u8>> {
        let s = TcpStream::connect(addr).await?;
        write_all(&s, request).await?;
        closed_within(&s, PROMPT).await.ok_or_else(|| io::Error::other("connection not closed"))
    }

    /// A normal request for `path`; the whole response.
    pub(crate) async fn get_path(addr: SocketAddr, path: &str) -> Option<String> {
        let request = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        let response = exchange(addr, request.as_bytes()).await.ok()?;
        String::from_utf8(response).ok()
    }

    /// A normal request; its status.
    async fn get(addr: SocketAddr) -> Option<u16> {
        status(get_path(addr, "/x").await?.as_bytes())
    }

    /// A free port on 127.0.0.1 (for servers whose start does not tell the port it bound).
    pub(crate) fn free_port() -> u16 {
        let probe = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).expect("bind");
        probe.local_addr().expect("local address").port()
    }

    /// What every server must withstand, given it serves `path` on `addr` (on 127.0.0.1) with
    /// `limits`: an oversized request is refused, a silent client is cut at the header timeout,
    /// the server is not reachable on 127.0.0.2, and it still answers `path` afterwards.
    pub(crate) async fn withstands_hostile_clients(addr: SocketAddr, path: &str, limits: Limits) {
        let response = exchange(addr, &request_with_header(limits.max_header_bytes + 1)).await.expect("exchange");
        assert!(matches!(status(&response), Some(431) | None), "{}", String::from_utf8_lossy(&response));
        let silent = TcpStream::connect(addr).await.expect("connect");
        closed_within(&silent, limits.header_timeout + PROMPT).await.expect("silent client not cut");
        let other = SocketAddr::new(std::net::Ipv4Addr::new(127, 0, 0, 2).into(), addr.port());
        let err = TcpStream::connect(other).await.expect_err("reachable on another address");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        let response = get_path(addr, path).await.expect("no answer after the hostile clients");
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    }

    fn request_with_header(value_len: usize) -> Vec<u8> {
        let mut r = b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Big: ".to_vec();
        r.resize(r.len() + value_len, b'a');
        r.extend_from_slice(b"\r\n\r\n");
        r
    }

    #[tokio::test]
    async fn oversized_headers_are_refused_and_the_server_keeps_serving() {
        bounded(async {
            let server = start(limits());
            // Under the limit: served.
            let response = exchange(server.addr, &request_with_header(600)).await.expect("exchange");
            assert_eq!(status(&response), Some(200), "{}", String::from_utf8_lossy(&response));
            // Over the limit (but under hyper's own 8 KiB buffer minimum), and far over it: refused
            // with 431, or the connection closed without an answer (a reset can swallow the 431).
            for len in [2048, 6000, 64 * 1024] {
                let response = exchange(server.addr, &request_with_header(len)).await.expect("exchange");
                let got = status(&response);
                assert!(matches!(got, Some(431) | None), "{len}-byte header answered {got:?}");
            }
            assert_eq!(get(server.addr).await, Some(200), "served after the oversized requests");
        })
        .await
    }

    #[tokio::test]
    async fn a_slow_client_is_cut_off_at_the_header_timeout_while_others_are_served() {
        bounded(async {
            // Long enough that a loaded machine serves the others before the slow client is cut.
            let limits = Limits { header_timeout: Duration::from_secs(1), ..limits() };
            let server = start(limits);
            let started = Instant::now();
            let slow = Arc::new(TcpStream::connect(server.addr).await.expect("connect"));
            // Slowloris: a header line every 50 ms, never the blank line that ends the headers.
            let writer = {
                let slow = Arc::clone(&slow);
                tokio::spawn(async move {
                    if write_all(&slow, b"GET / HTTP/1.1\r\n").await.is_err() {
                        return;
                    }
                    for _ in 0..200 {
                        sleep(Duration::from_millis(50)).await;
                        if write_all(&slow, b"X-A: b\r\n").await.is_err() {
                            return;
                        }
                    }
                })
            };
            for _ in 0..3 {
                assert_eq!(get(server.addr).await, Some(200), "served beside the slow client");
            }
            assert!(still_open(&slow), "the slow client was cut before the others were served");
            let response = closed_within(&slow, limits.header_timeout + PROMPT).await;
            let elapsed = started.elapsed();
            let response = response.expect("the slow client was not disconnected");
            assert_ne!(status(&response), Some(200));
            assert!(elapsed >= limits.header_timeout, "cut after {elapsed:?}, before the header timeout");
            writer.abort();
            assert_eq!(get(server.addr).await, Some(200));
        })
        .await
    }

    #[tokio::test]
    async fn idle_connections_are_closed_at_the_header_timeout() {
        bounded(async {
            let limits = limits();
            let server = start(limits);
            // Never sends a byte.
            let started = Instant::now();
            let idle = TcpStream::connect(server.addr).await.expect("connect");
            let response = closed_within(&idle, limits.header_timeout + PROMPT).await.expect("idle not closed");
            assert!(response.is_empty() || status(&response) == Some(408), "{response:?}");
            assert!(started.elapsed() >= limits.header_timeout);
            // Kept alive after one request, then silent: the header timeout applies again.
            let kept = TcpStream::connect(server.addr).await.expect("connect");
            write_all(&kept, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n").await.expect("write");
            let started = Instant::now();
            let response = closed_within(&kept, limits.header_timeout + PROMPT).await.expect("kept not closed");
            assert_eq!(status(&response), Some(200));
            assert!(started.elapsed() >= limits.header_timeout - Duration::from_millis(50));
        })
        .await
    }

    #[tokio::test]
    async fn the_connection_timeout_ends_a_client_that_keeps_asking() {
        bounded(async {
            let limits = Limits { connection_timeout: Duration::from_millis(800), ..limits() };
            let server = start(limits);
            let started = Instant::now();
            let s = Arc::new(TcpStream::connect(server.addr).await.expect("connect"));
            // A request every 100 ms, each well within the header timeout, on one connection.
            let writer = {
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    for _ in 0..100 {
                        if write_all(&s, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n").await.is_err() {
                            return;
                        }
                        sleep(Duration::from_millis(100)).await;
                    }
                })
            };
            let response = closed_within(&s, limits.connection_timeout + PROMPT).await;
            let elapsed = started.elapsed();
            writer.abort();
            let response = response.expect("the connection outlived its timeout");
            let answered = String::from_utf8_lossy(&response).matches("HTTP/1.1 200").count();
            assert!(answered >= 3, "only {answered} answers: the connection was not kept alive");
            assert!(elapsed >= limits.connection_timeout, "closed after {elapsed:?}");
        })
        .await
    }

    #[tokio::test]
    async fn excess_connections_are_closed_at_accept_and_the_server_recovers() {
        bounded(async {
            // A long header timeout, so only the connection cap can close the excess ones.
            let limits = Limits { max_connections: 2, header_timeout: Duration::from_secs(10), ..limits() };
            let server = start(limits);
            let a = TcpStream::connect(server.addr).await.expect("connect");
            let b = TcpStream::connect(server.addr).await.expect("connect");
            for _ in 0..3 {
                let excess = TcpStream::connect(server.addr).await.expect("connect");
                let response = closed_within(&excess, PROMPT).await.expect("excess connection left open");
                assert!(response.is_empty(), "{response:?}");
            }
            assert_eq!(get(server.addr).await, None, "served beyond the connection cap");
            assert!(still_open(&a) && still_open(&b), "the idle connections were closed");
            drop((a, b));
            // The server sees the two close and frees their slots.
            let deadline = Instant::now() + PROMPT;
            let mut served = None;
            while served.is_none() && Instant::now() < deadline {
                served = get(server.addr).await;
                if served.is_none() {
                    sleep(Duration::from_millis(20)).await;
                }
            }
            assert_eq!(served, Some(200), "not served after the idle connections closed");
        })
        .await
    }

    #[tokio::test]
    async fn a_large_body_is_answered_without_being_read() {
        bounded(async {
            let server = start(limits());
            let headers: [&[u8]; 2] = [
                b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\n",
                b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n",
            ];
            for head in headers {
                let s = TcpStream::connect(server.addr).await.expect("connect");
                // The headers and 1 KiB of a body that never ends.
                let mut request = head.to_vec();
                request.resize(request.len() + 1024, b'b');
                write_all(&s, &request).await.expect("write");
                let response = closed_within(&s, PROMPT).await.expect("waited for the body");
                assert_eq!(status(&response), Some(200), "{}", String::from_utf8_lossy(&response));
            }
            assert_eq!(get(server.addr).await, Some(200));
        })
        .await
    }

    #[tokio::test]
    async fn bound_only_to_the_configured_address() {
        bounded(async {
            let server = start(limits());
            assert_eq!(server.addr.ip(), std::net::Ipv4Addr::LOCALHOST);
            assert_eq!(get(server.addr).await, Some(200));
            // 127.0.0.2 is also this host (all of 127/8 is loopback), but not the bound address.
            let other = SocketAddr::from(([127, 0, 0, 2], server.addr.port()));
            let err = TcpStream::connect(other).await.expect_err("reachable on another address");
            assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        })
        .await
    }

    #[tokio::test]
    async fn stopping_closes_the_listener_and_connections() {
        bounded(async {
            let server = start(Limits { header_timeout: Duration::from_secs(10), ..limits() });
            let idle = TcpStream::connect(server.addr).await.expect("connect");
            let addr = server.addr;
            drop(server);
            closed_within(&idle, PROMPT).await.expect("connection open after stop");
            let err = TcpStream::connect(addr).await.expect_err("listening after stop");
            assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        })
        .await
    }
}

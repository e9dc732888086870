//! Port-forward into a VM pod. vesseld reaches the guest on vsock port
//! [`crate::vsock::FORWARD_PORT`] (through the shim's hybrid vsock socket), sends the pod port
//! as one line (`8080\n`); the agent connects to `127.0.0.1:PORT` (then `[::1]:PORT`) in the
//! guest, answers `OK\n` or `ERR <why>\n`, and from then on relays bytes both ways. A side
//! that closes its writing half is passed on as a half-close, so request/response protocols
//! that read to EOF work; the connection ends when both directions have.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long the host has to send its port line, and a connect may take.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Errors of the host's side of the handshake.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("port-forward to port {port}: {source}")]
    Io { port: u16, source: std::io::Error },
    #[error("port-forward to port {port}: the guest said {answer:?}")]
    Refused { port: u16, answer: String },
}

/// Reads one `\n`-terminated line of at most `max` bytes, byte by byte (what follows it is
/// payload and must stay unread).
async fn read_line<S: AsyncRead + Unpin>(s: &mut S, max: usize) -> std::io::Result<String> {
    use tokio::io::AsyncReadExt;
    let mut line = Vec::new();
    loop {
        let mut b = [0u8; 1];
        if s.read(&mut b).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(b[0]);
        if line.len() > max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "line too long",
            ));
        }
    }
}

/// The host's side: asks the guest for `port` on a fresh stream to the forward port and
/// returns the stream once the guest connected.
pub async fn open<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    port: u16,
) -> Result<S, ForwardError> {
    let io = |source| ForwardError::Io { port, source };
    s.write_all(format!("{port}\n").as_bytes())
        .await
        .map_err(io)?;
    let answer = tokio::time::timeout(HANDSHAKE + Duration::from_secs(5), read_line(&mut s, 512))
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(io)?;
    if answer == "OK" {
        Ok(s)
    } else {
        Err(ForwardError::Refused {
            port,
            answer: answer.strip_prefix("ERR ").unwrap_or(&answer).to_string(),
        })
    }
}

/// The guest's side of one connection: handshake, connect, relay.
pub async fn handle<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) {
    let port = match tokio::time::timeout(HANDSHAKE, read_line(&mut s, 16)).await {
        Ok(Ok(l)) => l.trim().parse::<u16>().ok().filter(|p| *p != 0),
        _ => None,
    };
    let Some(port) = port else {
        let _ = s.write_all(b"ERR bad port line\n").await;
        return;
    };
    let tcp = match connect_local(port).await {
        Ok(t) => t,
        Err(e) => {
            tracing::info!(port, error = %e, "port-forward: connect failed");
            let _ = s
                .write_all(format!("ERR connecting to localhost:{port}: {e}\n").as_bytes())
                .await;
            return;
        }
    };
    if s.write_all(b"OK\n").await.is_err() {
        return;
    }
    tracing::debug!(port, "port-forward: relaying");
    let mut tcp = tcp;
    let _ = tokio::io::copy_bidirectional(&mut s, &mut tcp).await;
}

async fn connect_local(port: u16) -> std::io::Result<TcpStream> {
    let v4 = SocketAddr::from(([127, 0, 0, 1], port));
    let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let attempt = |a| tokio::time::timeout(HANDSHAKE, TcpStream::connect(a));
    match attempt(v4).await {
        Ok(Ok(t)) => Ok(t),
        first => match attempt(v6).await {
            Ok(Ok(t)) => Ok(t),
            _ => match first {
                Ok(Err(e)) => Err(e),
                _ => Err(std::io::ErrorKind::TimedOut.into()),
            },
        },
    }
}

/// Serves forward connections from `listener` until the runtime ends.
pub async fn serve(listener: crate::vsock::VsockListener) -> std::io::Result<()> {
    use futures::StreamExt;
    let mut incoming = listener.incoming()?;
    while let Some(conn) = incoming.next().await {
        match conn {
            Ok(s) => {
                tokio::spawn(handle(s));
            }
            Err(e) => tracing::warn!(error = %e, "port-forward accept"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn relays_both_ways_with_half_close() {
        // An echo-until-EOF server on loopback, like a request/response service.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut all = Vec::new();
            c.read_to_end(&mut all).await.unwrap();
            all.reverse();
            c.write_all(&all).await.unwrap();
        });
        let (host, guest) = tokio::net::UnixStream::pair().unwrap();
        tokio::spawn(handle(guest));
        let mut s = open(host, port).await.unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        s.write_all(&payload).await.unwrap();
        s.shutdown().await.unwrap();
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.unwrap();
        let mut want = payload;
        want.reverse();
        assert_eq!(back, want);
    }

    #[tokio::test]
    async fn a_closed_port_and_a_bad_line_are_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let (host, guest) = tokio::net::UnixStream::pair().unwrap();
        tokio::spawn(handle(guest));
        match open(host, port).await {
            Err(ForwardError::Refused { answer, .. }) => {
                assert!(answer.contains(&format!("localhost:{port}")), "{answer}")
            }
            other => panic!("{other:?}"),
        }
        let (mut host, guest) = tokio::net::UnixStream::pair().unwrap();
        tokio::spawn(handle(guest));
        host.write_all(b"http\n").await.unwrap();
        let mut answer = String::new();
        host.read_to_string(&mut answer).await.unwrap();
        assert_eq!(answer, "ERR bad port line\n");
    }
}

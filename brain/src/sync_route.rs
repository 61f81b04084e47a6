//! `Sync` responses written by the brain itself, without copying the shared parts.
//!
//! tonic's encoder copies every message into a per-stream buffer before HTTP/2 writes it. For
//! the brain that buffer is the wrong shape: the bulk of each update is a part encoded once and
//! shared by every node ([`splitproxy_proto::frames::UpdateFrame`]), so copying it costs a
//! copy per node, and the buffer keeps the size of the largest update it ever held (up to
//! 64 KiB a stream once a snapshot went through: hundreds of MiB at thousands of nodes).
//!
//! [`SyncRoute`] takes `/splitproxy.v1.Dataplane/Sync` before the generated server does and
//! answers it with [`FrameBody`]: the gRPC length prefixes, the frames' own fields and pieces
//! under `CHUNK` bytes copied into buffers of up to that size made for the update, and each piece
//! of that size or more as the very `Bytes` every other node is sent. The bytes on the wire
//! are the same as tonic's (a unit test compares them). Authorisation, the Hello and the
//! session are the same code as the generated path (`DataplaneService::open_sync`); every
//! other method goes to the generated server.
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use futures::Stream;
use http_body::Frame;
use prost::Message;
use splitproxy_proto::frames::UpdateFrame;
use splitproxy_proto::v1::SyncRequest;
use tonic::body::Body;
use tonic::codec::{BufferSettings, Streaming};
use tonic::server::NamedService;
use tonic::{Request, Status};
use tonic_prost::ProstDecoder;

use crate::server::DataplaneService;
use crate::session::Session;

/// The path of the `Sync` method.
pub const SYNC_PATH: &str = "/splitproxy.v1.Dataplane/Sync";

/// Chunks handed to HTTP/2 are about this long: pieces are copied together up to it, and a
/// piece at least this long goes as it is. HTTP/2 queues every chunk of a stream it cannot send
/// yet in a per-connection table that never shrinks, so a snapshot of hundreds of parts must
/// not become hundreds of chunks (tonic's encoder yields at the same size).
const CHUNK: usize = 32 * 1024;

/// What a node sends is acks and drift reports, a few hundred bytes: the inbound buffer starts
/// small and grows only for a larger message.
const INBOUND_BUFFER: usize = 512;

/// gRPC's length prefix: a compressed flag and a 4-byte big-endian length.
const PREFIX: usize = 5;

/// Routes `Sync` to the brain's own encoder and everything else to `inner` (the generated
/// `Dataplane` server for the same service).
#[derive(Clone)]
pub struct SyncRoute<S> {
    service: DataplaneService,
    max_request: usize,
    max_message: usize,
    inner: S,
}

impl<S> SyncRoute<S> {
    /// `max_request`: the largest message a node may send; `max_message`: the largest update
    /// frame sent (as the generated server's decoding and encoding limits).
    pub fn new(
        service: DataplaneService,
        max_request: usize,
        max_message: usize,
        inner: S,
    ) -> Self {
        SyncRoute {
            service,
            max_request,
            max_message,
            inner,
        }
    }
}

impl<S: NamedService> NamedService for SyncRoute<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<Body>> for SyncRoute<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() != SYNC_PATH {
            return Box::pin(self.inner.call(request));
        }
        let service = self.service.clone();
        let (max_request, max_message) = (self.max_request, self.max_message);
        Box::pin(async move { Ok(sync(service, request, max_request, max_message).await) })
    }
}

/// Serves one `Sync` call: the node's messages decoded by tonic, the updates by [`FrameBody`].
async fn sync(
    service: DataplaneService,
    request: http::Request<Body>,
    max_request: usize,
    max_message: usize,
) -> http::Response<Body> {
    // Nodes never compress what they send (what they receive is compressed per part).
    if let Some(encoding) = request.headers().get("grpc-encoding")
        && encoding != "identity"
    {
        return Status::unimplemented(format!(
            "messages compressed with {encoding:?} are not accepted"
        ))
        .into_http();
    }
    let (parts, body) = request.into_parts();
    let decoder =
        ProstDecoder::<SyncRequest>::new(BufferSettings::new(INBOUND_BUFFER, INBOUND_BUFFER));
    let inbound = Streaming::new_request(decoder, body, None, Some(max_request));
    let request = Request::from_http(http::Request::from_parts(parts, inbound));
    match service.open_sync(request).await {
        Ok(updates) => http::Response::builder()
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .body(Body::new(FrameBody::new(updates, max_message)))
            .unwrap_or_else(|e| Status::internal(e.to_string()).into_http()),
        Err(status) => status.into_http(),
    }
}

/// A node's `Sync` response: each update's frames as gRPC messages, then the status the
/// session ended with as trailers. Polling it for the next update runs the session
/// ([`crate::session`]): HTTP/2's task for the stream is the session's task.
pub struct FrameBody<S = Session> {
    updates: S,
    max_message: usize,
    /// Chunks of the current update not yet handed to HTTP/2.
    chunks: VecDeque<Bytes>,
    ended: bool,
}

impl<S> FrameBody<S> {
    pub fn new(updates: S, max_message: usize) -> Self {
        FrameBody {
            updates,
            max_message,
            chunks: VecDeque::new(),
            ended: false,
        }
    }

    fn trailers(status: &Status) -> Frame<Bytes> {
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
        }
        Frame::trailers(trailers)
    }
}

impl<S> http_body::Body for FrameBody<S>
where
    S: Stream<Item = Result<Vec<UpdateFrame>, Status>> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(chunk) = this.chunks.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.updates).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frames))) => {
                    if let Err(status) = encode(&frames, this.max_message, &mut this.chunks) {
                        this.chunks.clear();
                        this.ended = true;
                        return Poll::Ready(Some(Ok(Self::trailers(&status))));
                    }
                }
                Poll::Ready(Some(Err(status))) => {
                    this.ended = true;
                    return Poll::Ready(Some(Ok(Self::trailers(&status))));
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    return Poll::Ready(Some(Ok(Self::trailers(&Status::ok("")))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.chunks.is_empty()
    }
}

/// Appends `frames` to `chunks` as gRPC messages: prefixes, the frames' own fields and pieces
/// shorter than `CHUNK` copied into buffers of about that size, made for this update and
/// freed once written; longer pieces as they are.
pub fn encode(
    frames: &[UpdateFrame],
    max_message: usize,
    chunks: &mut VecDeque<Bytes>,
) -> Result<(), Status> {
    let copied = |b: &Bytes| if b.len() < CHUNK { b.len() } else { 0 };
    let mut out = Chunks {
        // What is still to be copied (at most): a new buffer is made for that, up to CHUNK,
        // so a small update allocates what it needs and a large one CHUNK at a time.
        rest: frames
            .iter()
            .map(|f| PREFIX + HEAD_MAX + copied(&f.shared) + copied(&f.extra))
            .sum(),
        buf: BytesMut::new(),
        chunks,
    };
    for frame in frames {
        let len = frame.encoded_len();
        if len > max_message {
            return Err(Status::out_of_range(format!(
                "an update frame of {len} bytes is larger than the limit of {max_message}"
            )));
        }
        out.room(PREFIX + HEAD_MAX);
        out.buf.put_u8(0);
        out.buf.put_u32(len as u32);
        frame.encode_head(&mut out.buf);
        for piece in [&frame.shared, &frame.extra] {
            if piece.len() >= CHUNK {
                out.flush();
                out.chunks.push_back(piece.clone());
            } else {
                out.room(piece.len());
                out.buf.extend_from_slice(piece);
            }
        }
    }
    out.flush();
    Ok(())
}

/// The chunks of one update as they are made.
struct Chunks<'a> {
    rest: usize,
    buf: BytesMut,
    chunks: &'a mut VecDeque<Bytes>,
}

impl Chunks<'_> {
    /// Makes room for `need` more bytes in the buffer: a new chunk when the current one would
    /// pass CHUNK.
    fn room(&mut self, need: usize) {
        if !self.buf.is_empty() && self.buf.len() + need > CHUNK {
            self.flush();
        }
        if self.buf.capacity() - self.buf.len() < need {
            self.buf.reserve(need.max(self.rest.min(CHUNK)));
        }
        self.rest = self.rest.saturating_sub(need);
    }

    /// Moves what the buffer holds to the chunks, leaving it empty with no allocation (the
    /// next one is never shared with a chunk still queued).
    fn flush(&mut self) {
        if !self.buf.is_empty() {
            self.chunks
                .push_back(std::mem::take(&mut self.buf).freeze());
        }
    }
}

/// The longest a frame's header fields encode to: three `uint64` fields of 1 + 10 bytes.
const HEAD_MAX: usize = 33;

#[cfg(test)]
mod tests {
    use super::*;

    /// What tonic's prost encoder writes for `frames`: each message's prost encoding
    /// (`ProstEncoder` is `Message::encode`) behind gRPC's uncompressed length prefix.
    fn tonic_bytes(frames: &[UpdateFrame]) -> Vec<u8> {
        let mut out = Vec::new();
        for frame in frames {
            let message = frame.encode_to_vec();
            out.push(0);
            out.extend_from_slice(&(message.len() as u32).to_be_bytes());
            out.extend_from_slice(&message);
        }
        out
    }

    fn frame(generation: u64, shared: usize, extra: usize) -> UpdateFrame {
        UpdateFrame {
            brain_epoch: 7,
            generation,
            base_generation: generation.saturating_sub(1),
            shared: Bytes::from(vec![0x0a; shared]),
            extra: Bytes::from(vec![0x12; extra]),
        }
    }

    #[test]
    fn the_bytes_are_tonics_and_long_parts_are_not_copied() {
        let frames = vec![
            frame(1, 10, 3),
            frame(2, 40_000, 0),
            frame(3, 0, 20_000),
            frame(4, 20_000, 5),
            frame(5, 5, 5),
        ];
        let mut chunks = VecDeque::new();
        encode(&frames, usize::MAX, &mut chunks).unwrap();
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert_eq!(joined, tonic_bytes(&frames));
        // The piece of a chunk's size or more is the frame's own allocation, not a copy.
        assert!(
            chunks
                .iter()
                .any(|c| c.as_ptr() == frames[1].shared.as_ptr())
        );
        // Shorter pieces are copied together into chunks of at most CHUNK: the first frame
        // with the second's head; the long part; the third frame (20,000 bytes) with the
        // fourth's head; the fourth's 20,000 with the last frame.
        assert_eq!(
            chunks.len(),
            4,
            "{:?}",
            chunks.iter().map(Bytes::len).collect::<Vec<_>>()
        );
        assert!(chunks.iter().all(|c| c.len() <= CHUNK || c.len() == 40_000));
    }

    #[test]
    fn a_snapshot_of_many_parts_is_few_chunks() {
        let frames: Vec<_> = (1..=200).map(|g| frame(g, 6_000, 0)).collect();
        let mut chunks = VecDeque::new();
        encode(&frames, usize::MAX, &mut chunks).unwrap();
        let total: usize = chunks.iter().map(Bytes::len).sum();
        assert_eq!(total, tonic_bytes(&frames).len());
        assert!(
            chunks.len() <= total / (CHUNK - 6_100) + 1,
            "{} chunks",
            chunks.len()
        );
    }

    #[test]
    fn a_small_update_is_one_chunk() {
        let mut chunks = VecDeque::new();
        encode(
            &[frame(9, 300, 40), frame(10, 0, 12)],
            usize::MAX,
            &mut chunks,
        )
        .unwrap();
        assert_eq!(chunks.len(), 1);
        assert_eq!(
            chunks[0].to_vec(),
            tonic_bytes(&[frame(9, 300, 40), frame(10, 0, 12)])
        );
    }

    #[test]
    fn a_frame_over_the_limit_is_refused() {
        let mut chunks = VecDeque::new();
        let e = encode(&[frame(1, 5_000, 0)], 4_096, &mut chunks).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
    }

    #[tokio::test]
    async fn the_body_ends_with_the_sessions_status() {
        use http_body_util::BodyExt;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(Ok(vec![frame(1, 10, 0)])).await.unwrap();
        tx.send(Err(Status::unavailable("brain shutting down")))
            .await
            .unwrap();
        drop(tx);
        let mut body = FrameBody::new(tokio_stream::wrappers::ReceiverStream::new(rx), usize::MAX);
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(data.to_vec(), tonic_bytes(&[frame(1, 10, 0)]));
        let trailers = body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(trailers["grpc-status"], "14");
        assert!(body.frame().await.is_none());
        assert!(http_body::Body::is_end_stream(&body));
    }
}

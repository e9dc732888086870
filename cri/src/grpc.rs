//! Glue between tonic's generated service traits and vessel's services.
//!
//! tonic's traits are `#[async_trait]` traits. Most CRI methods are one call on the runtime
//! and one reply message, so the services write them as a table with [`rpcs!`] rather than
//! as dozens of four-line signatures around a one-line body.

use crate::errors::RuntimeError;
use tonic::Status;

/// Implements tonic service methods, one line each: `name(Request) -> Reply = body;`.
///
/// `Request` and `Reply` are `vessel_cri_api::v1` messages. `body` is an expression that may
/// `.await` and use `?` (with [`RuntimeError`] or [`Status`] errors), of type
/// `Result<Reply, Status>`; it reads the service as `$s` and the request message as `$r`,
/// the two names given first: `rpcs! { |s, r| version(VersionRequest) -> ... = ...; }`.
///
/// It is written inside a `#[tonic::async_trait]` impl and produces the methods as that
/// attribute would (a boxed future each), because the attribute does not look into macros.
macro_rules! rpcs {
    (|$s:ident, $r:ident| $( $name:ident($req:ident) -> $reply:ident = $body:expr; )*) => {$(
        $crate::grpc::rpc_method!($name, $req, ::vessel_cri_api::v1::$reply, |$s, $r| $body);
    )*};
}
pub(crate) use rpcs;

/// Implements CRI's `Stream*` RPCs (the list calls as server streams, which kubelet and crictl
/// 1.36 try before the unary ones), one line each:
/// `name(Request) -> StreamType of Reply { field } = items;`. `items` is the list the unary
/// call answers (it may `.await` and use `?`, as in [`rpcs!`]); the stream sends it in
/// replies of about [`STREAM_CHUNK_BYTES`] each, `field` holding a reply's items.
macro_rules! list_streams {
    (|$s:ident, $r:ident| $( $name:ident($req:ident) -> $stream:ident of $reply:ident { $field:ident } = $body:expr; )*) => {$(
        type $stream = $crate::grpc::ListStream<::vessel_cri_api::v1::$reply>;

        $crate::grpc::rpc_method!($name, $req, Self::$stream, |$s, $r| {
            let items = $body;
            Ok($crate::grpc::list_stream(items, |v| ::vessel_cri_api::v1::$reply { $field: v }))
        });
    )*};
}
pub(crate) use list_streams;

/// One method of a `#[tonic::async_trait]` service trait, as that attribute writes it: `body`
/// (of type `Result<Reply, Status>`, reading the service as `$s` and the request as `$r`)
/// in a boxed future. For [`rpcs!`] and [`list_streams!`].
macro_rules! rpc_method {
    ($name:ident, $req:ident, $reply:ty, |$s:ident, $r:ident| $body:expr) => {
        fn $name<'life0, 'async_trait>(
            &'life0 self,
            request: ::tonic::Request<::vessel_cri_api::v1::$req>,
        ) -> ::std::pin::Pin<
            Box<
                dyn ::std::future::Future<
                        Output = Result<::tonic::Response<$reply>, ::tonic::Status>,
                    > + Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                #[allow(unused_variables)]
                let $s = self;
                #[allow(unused_variables)]
                let $r = request.into_inner();
                let reply: Result<$reply, ::tonic::Status> = $body;
                reply.map(::tonic::Response::new)
            })
        }
    };
}
pub(crate) use rpc_method;

/// The reply stream of a `Stream*` RPC.
pub type ListStream<R> =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<R, Status>> + Send + 'static>>;

/// How many bytes of items one reply of a `Stream*` RPC carries at most (a single larger
/// item goes alone): far under the 16 MiB that kubelet's and crictl's clients accept in one
/// message, which is what a long unary list runs into and streaming exists for.
pub const STREAM_CHUNK_BYTES: usize = 1 << 20;

/// `items` as a stream of replies of at most [`STREAM_CHUNK_BYTES`] of items each, in order;
/// no reply for no items (the client reads until the stream ends).
pub fn list_stream<T: prost::Message, R: Send + 'static>(
    items: Vec<T>,
    wrap: impl Fn(Vec<T>) -> R,
) -> ListStream<R> {
    let replies: Vec<Result<R, Status>> = chunks(items, STREAM_CHUNK_BYTES)
        .into_iter()
        .map(|c| Ok(wrap(c)))
        .collect();
    Box::pin(futures::stream::iter(replies))
}

/// `items` cut, in order, into runs whose encoded sizes add up to at most `limit` bytes (an
/// item larger than that is a run of its own).
fn chunks<T: prost::Message>(items: Vec<T>, limit: usize) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    let (mut run, mut bytes) = (Vec::new(), 0);
    for item in items {
        let n = item.encoded_len();
        if !run.is_empty() && bytes + n > limit {
            out.push(std::mem::take(&mut run));
            bytes = 0;
        }
        bytes += n;
        run.push(item);
    }
    if !run.is_empty() {
        out.push(run);
    }
    out
}

/// The reply to a call that returns nothing but success: an empty message.
pub fn done<T: Default>(r: Result<(), RuntimeError>) -> Result<T, Status> {
    r.map(|()| T::default()).map_err(Status::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vessel_cri_api::v1 as cri;

    fn image(id: &str) -> cri::Image {
        cri::Image {
            id: id.into(),
            ..Default::default()
        }
    }

    #[test]
    fn stream_replies_keep_order_and_stay_under_the_limit() {
        assert!(chunks(Vec::<cri::Image>::new(), 100).is_empty());
        let ids: Vec<String> = (0..50).map(|i| format!("sha256:{i:064}")).collect();
        let each = prost::Message::encoded_len(&image(&ids[0]));
        let runs = chunks(ids.iter().map(|i| image(i)).collect(), each * 7 + 3);
        assert_eq!(runs.len(), 8);
        assert!(runs.iter().all(|r| !r.is_empty() && r.len() <= 7));
        let back: Vec<String> = runs.into_iter().flatten().map(|i| i.id).collect();
        assert_eq!(back, ids);
        // An item larger than the limit goes alone.
        let runs = chunks(vec![image("a"), image(&"b".repeat(200)), image("c")], 50);
        assert_eq!(runs.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
    }
}

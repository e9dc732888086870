//! Glue between tonic's generated service traits and vessel's services.
//!
//! tonic's traits are `#[async_trait]` traits. Most CRI methods are one call on the runtime
//! and one reply message, so the services write them as a table with [`rpcs!`] rather than
//! as dozens of four-line signatures around a one-line body.

use crate::errors::RuntimeError;
use tonic::Status;

/// Implements tonic service methods, one line each: `name(Request) -> Reply = body;`.
///
/// `Request` and `Reply` are `k8s_cri::v1` messages. `body` is an expression that may
/// `.await` and use `?` (with [`RuntimeError`] or [`Status`] errors), of type
/// `Result<Reply, Status>`; it reads the service as `$s` and the request message as `$r`,
/// the two names given first: `rpcs! { |s, r| version(VersionRequest) -> ... = ...; }`.
///
/// It is written inside a `#[tonic::async_trait]` impl and produces the methods as that
/// attribute would (a boxed future each), because the attribute does not look into macros.
macro_rules! rpcs {
    (|$s:ident, $r:ident| $( $name:ident($req:ident) -> $reply:ident = $body:expr; )*) => {$(
        fn $name<'life0, 'async_trait>(
            &'life0 self,
            request: ::tonic::Request<::k8s_cri::v1::$req>,
        ) -> ::std::pin::Pin<
            Box<
                dyn ::std::future::Future<
                        Output = Result<::tonic::Response<::k8s_cri::v1::$reply>, ::tonic::Status>,
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
                let reply: Result<::k8s_cri::v1::$reply, ::tonic::Status> = $body;
                reply.map(::tonic::Response::new)
            })
        }
    )*};
}
pub(crate) use rpcs;

/// The reply to a call that returns nothing but success: an empty message.
pub fn done<T: Default>(r: Result<(), RuntimeError>) -> Result<T, Status> {
    r.map(|()| T::default()).map_err(Status::from)
}

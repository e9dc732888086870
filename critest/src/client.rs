//! CRI clients over a Unix socket, for any CRI runtime (vessel or containerd).

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use std::path::{Path, PathBuf};
use tonic::transport::{Channel, Endpoint, Uri};

/// Connects a channel to the CRI socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    Endpoint::try_from("http://[::1]:0")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
}

/// Both CRI services on one channel.
#[derive(Clone)]
pub struct CriClient {
    pub runtime: RuntimeServiceClient<Channel>,
    pub images: ImageServiceClient<Channel>,
}

impl CriClient {
    pub async fn connect(path: &Path) -> Result<CriClient, tonic::transport::Error> {
        let ch = connect(path).await?;
        Ok(CriClient {
            runtime: RuntimeServiceClient::new(ch.clone()).max_decoding_message_size(16 << 20),
            images: ImageServiceClient::new(ch).max_decoding_message_size(16 << 20),
        })
    }
}

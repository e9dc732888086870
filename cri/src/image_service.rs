//! CRI ImageService over vessel's image store.

use crate::errors::image_status;
use crate::grpc::{list_streams, rpcs};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tonic::Status;
use vessel_cri_api::v1 as cri;
use vessel_images::store::ImageRecord;
use vessel_images::{Credentials, ImageStore, Puller};

pub struct ImageService {
    puller: Arc<Puller>,
}

impl ImageService {
    pub fn new(puller: Arc<Puller>) -> Self {
        ImageService { puller }
    }

    fn store(&self) -> Arc<ImageStore> {
        self.puller.store().clone()
    }
}

/// Runs blocking store work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("image store task failed: {e}")))?
}

/// uid or username from an image's `User` (`1000`, `1000:1000`, `name`, `name:group`), as
/// kubelet expects them for runAsNonRoot checks.
pub fn user_fields(user: Option<&str>) -> (Option<i64>, String) {
    let user = user.unwrap_or("").trim();
    if user.is_empty() {
        return (None, String::new());
    }
    let u = user.split(':').next().unwrap_or("");
    match u.parse::<i64>() {
        Ok(uid) => (Some(uid), String::new()),
        Err(_) => (None, u.to_string()),
    }
}

pub fn to_cri_image(r: &ImageRecord) -> cri::Image {
    let (uid, username) = user_fields(r.run_config.user.as_deref());
    cri::Image {
        id: r.id.to_string(),
        repo_tags: r.repo_tags.clone(),
        repo_digests: r.repo_digests.clone(),
        size: r.size,
        uid: uid.map(|value| cri::Int64Value { value }),
        username,
        spec: Some(cri::ImageSpec {
            image: r.id.to_string(),
            ..Default::default()
        }),
        pinned: r.pinned,
    }
}

fn image_name(spec: Option<&cri::ImageSpec>) -> Result<String, Status> {
    let name = spec.map(|s| s.image.trim()).unwrap_or("");
    if name.is_empty() {
        return Err(Status::invalid_argument("image spec has no image name"));
    }
    Ok(name.to_string())
}

impl ImageService {
    async fn list(
        &self,
        filter: Option<cri::ImageFilter>,
    ) -> Result<cri::ListImagesResponse, Status> {
        let filter = filter
            .and_then(|f| f.image)
            .map(|s| s.image)
            .filter(|s| !s.trim().is_empty());
        let store = self.store();
        let images = blocking(move || match filter {
            Some(q) => store
                .find(&q)
                .map(|r| r.into_iter().collect::<Vec<_>>())
                .map_err(|e| image_status(&e)),
            None => store.list().map_err(|e| image_status(&e)),
        })
        .await?;
        Ok(cri::ListImagesResponse {
            images: images.iter().map(to_cri_image).collect(),
        })
    }

    async fn status(
        &self,
        name: String,
        verbose: bool,
    ) -> Result<cri::ImageStatusResponse, Status> {
        let store = self.store();
        let rec = blocking(move || store.find(&name).map_err(|e| image_status(&e))).await?;
        // The CRI contract: an image that is not present is a nil image, not an error
        // (kubelet asks this before every pull).
        let Some(rec) = rec else {
            return Ok(cri::ImageStatusResponse::default());
        };
        let mut info = HashMap::new();
        if verbose {
            let store = self.store();
            let cfg = rec.config.digest.clone();
            let config = blocking(move || store.read_blob(&cfg).map_err(|e| image_status(&e)))
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
            let v = serde_json::json!({
                "manifest": rec.manifest,
                "platform": rec.platform,
                "layers": rec.layers,
                "pulledAt": rec.pulled_at,
                // The image's OCI config under the name containerd and CRI-O give it
                // (`crictl inspecti` users read `info.imageSpec.config`).
                "imageSpec": config,
            });
            info.insert("info".to_string(), v.to_string());
        }
        Ok(cri::ImageStatusResponse {
            image: Some(to_cri_image(&rec)),
            info,
        })
    }

    async fn pull(
        &self,
        name: String,
        auth: Option<cri::AuthConfig>,
    ) -> Result<cri::PullImageResponse, Status> {
        let creds = auth
            .map(|a| {
                let mut c = Credentials::from_cri(
                    &a.username,
                    &a.password,
                    &a.auth,
                    &a.identity_token,
                    &a.registry_token,
                );
                c.server_address = a.server_address;
                c
            })
            .unwrap_or_default();
        let t = Instant::now();
        let res = self.puller.pull(&name, &creds).await;
        crate::metrics::get().record_pull(res.is_ok(), t.elapsed());
        match res {
            Ok(rep) => {
                crate::metrics::get().add_pulled_bytes(rep.bytes_downloaded);
                Ok(cri::PullImageResponse {
                    image_ref: rep.image.id.to_string(),
                })
            }
            Err(e) => {
                tracing::warn!(image = %name, error = %e, "PullImage failed");
                Err(image_status(&e))
            }
        }
    }

    async fn remove(&self, name: String) -> Result<cri::RemoveImageResponse, Status> {
        let store = self.store();
        let deleted = blocking(move || {
            let users = store.clone();
            store
                .remove(&name, &|id| {
                    let u = users.snapshot_users(id);
                    (!u.is_empty()).then(|| format!("container snapshots {}", u.join(", ")))
                })
                .map_err(|e| image_status(&e))
        })
        .await?;
        for id in deleted {
            tracing::info!(image = %id, "image removed");
        }
        Ok(cri::RemoveImageResponse {})
    }

    async fn fs_info(&self) -> Result<cri::ImageFsInfoResponse, Status> {
        let store = self.store();
        let (root, all, ctrs) = blocking(move || {
            let all = store.usage().map_err(|e| image_status(&e))?;
            let ctrs = store.snapshots_usage().map_err(|e| image_status(&e))?;
            Ok((store.root().to_path_buf(), all, ctrs))
        })
        .await?;
        let now = chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0);
        let usage = |(bytes, inodes): (u64, u64)| cri::FilesystemUsage {
            timestamp: now,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: root.display().to_string(),
            }),
            used_bytes: Some(cri::UInt64Value { value: bytes }),
            inodes_used: Some(cri::UInt64Value { value: inodes }),
        };
        // The containers' writable layers (snapshots/) are on the image store's filesystem:
        // one mountpoint for both, so kubelet sees no split image filesystem (a different
        // mountpoint would make it apply split-disk eviction and GC to one disk). The image
        // filesystem's usage includes the writable layers, as before.
        Ok(cri::ImageFsInfoResponse {
            image_filesystems: vec![usage(all)],
            container_filesystems: vec![usage(ctrs)],
        })
    }
}

#[tonic::async_trait]
impl cri::image_service_server::ImageService for ImageService {
    // One line per RPC, as in the RuntimeService.
    #[rustfmt::skip]
    rpcs! { |s, r|
        list_images(ListImagesRequest) -> ListImagesResponse = s.list(r.filter).await;
        image_status(ImageStatusRequest) -> ImageStatusResponse = s.status(image_name(r.image.as_ref())?, r.verbose).await;
        pull_image(PullImageRequest) -> PullImageResponse = s.pull(image_name(r.image.as_ref())?, r.auth).await;
        remove_image(RemoveImageRequest) -> RemoveImageResponse = s.remove(image_name(r.image.as_ref())?).await;
        image_fs_info(ImageFsInfoRequest) -> ImageFsInfoResponse = s.fs_info().await;
    }

    #[rustfmt::skip]
    list_streams! { |s, r|
        stream_images(StreamImagesRequest) -> StreamImagesStream of StreamImagesResponse { images } = s.list(r.filter).await?.images;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_field_mapping() {
        assert_eq!(user_fields(None), (None, String::new()));
        assert_eq!(user_fields(Some("1000")), (Some(1000), String::new()));
        assert_eq!(user_fields(Some("1000:1000")), (Some(1000), String::new()));
        assert_eq!(user_fields(Some("0")), (Some(0), String::new()));
        assert_eq!(user_fields(Some("vessel")), (None, "vessel".to_string()));
        assert_eq!(
            user_fields(Some("nobody:nogroup")),
            (None, "nobody".to_string())
        );
    }
}

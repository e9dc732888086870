//! The suite's test images: deterministic busybox images from `vessel_images::testimages`,
//! pushed under `<registry>/vessel-critest/`.

use vessel_images::oci::RunConfig;
use vessel_images::push::{push_image, PushError, PushTarget};
use vessel_images::testimages::{
    busybox_image, image_from_blobs, user_image, BuiltImage, Compression, BUSYBOX_PATH_ENV,
};

/// The image names the specs use.
#[derive(Debug, Clone)]
pub struct Images {
    /// `<registry>/vessel-critest/busybox:1`: the workhorse for containers.
    pub busybox: String,
    /// `<registry>/vessel-critest/busybox:2`: the same image under a second tag.
    pub busybox2: String,
    /// busybox with `User 1000`.
    pub user_uid: String,
    /// busybox with `User vessel` (uid 1000 in its /etc/passwd).
    pub user_name: String,
    /// Per-spec image repositories (`<registry>/vessel-critest/img-<variant>`), each a
    /// distinct image id so that image specs never disturb each other or the workhorse.
    pub variants: Vec<(String, String, String)>,
}

/// The variants: (name, repository, manifest digest).
pub const VARIANTS: &[&str] = &["bytag", "bydigest", "notag", "list", "tags"];

impl Images {
    pub fn all(&self) -> Vec<String> {
        let mut v = vec![
            self.busybox.clone(),
            self.busybox2.clone(),
            self.user_uid.clone(),
            self.user_name.clone(),
        ];
        for (_, repo, _) in &self.variants {
            v.push(format!("{repo}:a"));
            v.push(format!("{repo}:b"));
            v.push(format!("{repo}:latest"));
        }
        v
    }

    /// (repository, manifest digest) of a variant.
    pub fn variant(&self, name: &str) -> (String, String) {
        self.variants
            .iter()
            .find(|v| v.0 == name)
            .map(|v| (v.1.clone(), v.2.clone()))
            .unwrap_or_default()
    }
}

fn variant_image(name: &str) -> BuiltImage {
    let base = busybox_image(Compression::Gzip);
    let run = RunConfig {
        env: Some(vec![
            BUSYBOX_PATH_ENV.to_string(),
            format!("VESSEL_CRITEST_VARIANT={name}"),
        ]),
        cmd: Some(vec!["sh".to_string()]),
        ..RunConfig::default()
    };
    let platform = base.platform();
    image_from_blobs(base.layers, base.diff_ids, run, platform)
}

/// The names, without pushing (the registry already has them).
pub fn names(host: &str) -> Images {
    let variants = VARIANTS
        .iter()
        .map(|v| {
            (
                v.to_string(),
                format!("{host}/vessel-critest/img-{v}"),
                variant_image(v).manifest_digest().to_string(),
            )
        })
        .collect();
    Images {
        busybox: format!("{host}/vessel-critest/busybox:1"),
        busybox2: format!("{host}/vessel-critest/busybox:2"),
        user_uid: format!("{host}/vessel-critest/user:1000"),
        user_name: format!("{host}/vessel-critest/user:vessel"),
        variants,
    }
}

/// Pushes every test image to the registry at `base_url` (`http://HOST:PORT`), whose
/// image names start with `host`.
pub async fn push_all(base_url: &str, host: &str) -> Result<Images, PushError> {
    let target = |repo: &str| {
        let mut t = PushTarget::new(base_url, repo);
        t.insecure_tls = true;
        t
    };
    let bb = busybox_image(Compression::Gzip);
    push_image(&target("vessel-critest/busybox"), &bb, Some("1")).await?;
    push_image(&target("vessel-critest/busybox"), &bb, Some("2")).await?;
    push_image(
        &target("vessel-critest/user"),
        &user_image("1000"),
        Some("1000"),
    )
    .await?;
    push_image(
        &target("vessel-critest/user"),
        &user_image("vessel"),
        Some("vessel"),
    )
    .await?;
    for v in VARIANTS {
        let img = variant_image(v);
        let t = target(&format!("vessel-critest/img-{v}"));
        for tag in ["a", "b", "latest"] {
            push_image(&t, &img, Some(tag)).await?;
        }
    }
    Ok(names(host))
}

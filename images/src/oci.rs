//! OCI image-spec and Docker v2 schema 2 documents, as far as vessel reads and writes them.
//! Parsing is lenient about fields we do not use and strict about the ones we do.

use crate::digest::Digest;
use crate::error::ImageError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MT_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MT_OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
pub const MT_OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const MT_OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const MT_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const MT_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const MT_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const MT_DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const MT_DOCKER_LAYER_FOREIGN: &str =
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip";

/// The `Accept` header for manifest requests: everything we can resolve.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
application/vnd.docker.distribution.manifest.list.v2+json, \
application/vnd.oci.image.manifest.v1+json, \
application/vnd.docker.distribution.manifest.v2+json";

/// True for media types of image indexes / manifest lists.
pub fn is_index(media_type: &str) -> bool {
    media_type == MT_OCI_INDEX || media_type == MT_DOCKER_LIST
}

/// True for media types of single-platform manifests.
pub fn is_manifest(media_type: &str) -> bool {
    media_type == MT_OCI_MANIFEST || media_type == MT_DOCKER_MANIFEST
}

/// True for layer media types we can apply (compression is detected from the bytes).
pub fn is_layer(media_type: &str) -> bool {
    matches!(
        media_type,
        MT_OCI_LAYER
            | MT_OCI_LAYER_GZIP
            | MT_OCI_LAYER_ZSTD
            | MT_DOCKER_LAYER_GZIP
            | MT_DOCKER_LAYER_FOREIGN
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
    )
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
}

impl Descriptor {
    pub fn new(media_type: &str, data: &[u8]) -> Self {
        Descriptor {
            media_type: media_type.to_string(),
            digest: Digest::of(data),
            size: data.len() as u64,
            platform: None,
            annotations: BTreeMap::new(),
            urls: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    #[serde(
        rename = "os.version",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub os_version: Option<String>,
}

impl Platform {
    /// Parses `os/arch[/variant]`, e.g. `linux/amd64` or `linux/arm64/v8`.
    pub fn parse(s: &str) -> Option<Platform> {
        let mut it = s.split('/');
        let os = it.next().filter(|s| !s.is_empty())?;
        let arch = it.next().filter(|s| !s.is_empty())?;
        let variant = it.next().map(str::to_string);
        if it.next().is_some() {
            return None;
        }
        Some(Platform {
            architecture: arch.to_string(),
            os: os.to_string(),
            variant,
            os_version: None,
        })
    }

    /// Whether `other` (from an index) can serve a node of this platform.
    pub fn matches(&self, other: &Platform) -> bool {
        if self.os != other.os || self.architecture != other.architecture {
            return false;
        }
        match (&self.variant, &other.variant) {
            (Some(want), Some(have)) => want == have,
            // arm64 images usually carry v8 or nothing; accept either when we did not ask.
            _ => true,
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// An OCI image index or a Docker manifest list.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub manifests: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Index {
    /// The image manifest of this index for a node of platform `want`: one whose platform
    /// is `want` exactly (its variant too, or neither has one) first, then one `want`
    /// [matches](Platform::matches), then one that names no platform (the field is
    /// optional: a single-image index often leaves it out, and containerd takes such an
    /// entry), as a manifest without an index is taken.
    pub fn manifest_for(&self, want: &Platform) -> Option<&Descriptor> {
        let manifests = || self.manifests.iter().filter(|d| is_manifest(&d.media_type));
        manifests()
            .find(|d| {
                d.platform
                    .as_ref()
                    .is_some_and(|p| want.matches(p) && p.variant == want.variant)
            })
            .or_else(|| manifests().find(|d| d.platform.as_ref().is_some_and(|p| want.matches(p))))
            .or_else(|| manifests().find(|d| d.platform.is_none()))
    }

    /// [`manifest_for`](Index::manifest_for), or the error for image `reference` that
    /// names the platforms this index offers.
    pub fn choose(&self, want: &Platform, reference: &str) -> Result<&Descriptor, ImageError> {
        self.manifest_for(want)
            .ok_or_else(|| ImageError::NoMatchingPlatform {
                reference: reference.to_string(),
                platform: want.to_string(),
                available: self
                    .manifests
                    .iter()
                    .filter_map(|d| d.platform.as_ref().map(|p| p.to_string()))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// An OCI image manifest or a Docker v2 schema 2 manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The image configuration (the blob whose digest is the image ID).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ImageConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<RunConfig>,
    pub rootfs: RootFs,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<serde_json::Value>,
}

impl ImageConfig {
    /// The platform this image says it was built for.
    pub fn platform(&self) -> Platform {
        Platform {
            architecture: self.architecture.clone(),
            os: self.os.clone(),
            variant: self.variant.clone(),
            os_version: None,
        }
    }

    /// Checks that this image, reached through `entry` (of an index that
    /// [chose](Index::choose) it, an OCI layout's `index.json`, or one made up for a docker
    /// archive), runs on a node of platform `want`: by the platform the entry names, else
    /// the one this config declares (as containerd checks an entry that names none), or
    /// the image would fail at every start with an exec format error.
    pub fn check_index_entry(
        &self,
        entry: &Descriptor,
        want: &Platform,
        reference: &str,
    ) -> Result<(), ImageError> {
        // What the entry names, else what the config declares (a config that declares
        // nothing is taken at its word).
        let declared = entry.platform.clone().unwrap_or_else(|| self.platform());
        let unknown = declared.os.is_empty() || declared.architecture.is_empty();
        if !unknown && !want.matches(&declared) {
            return Err(ImageError::NoMatchingPlatform {
                reference: reference.to_string(),
                platform: want.to_string(),
                available: declared.to_string(),
            });
        }
        Ok(())
    }
}

/// The runtime defaults an image carries (`config` in the image config).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<BTreeMap<String, serde_json::Value>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<Digest>,
}

/// Which kind of document a manifest response is, from its media type or, when a registry
/// sends none, from its shape.
pub fn sniff_media_type(header: Option<&str>, body: &[u8]) -> Option<String> {
    if let Some(h) = header {
        let h = h.split(';').next().unwrap_or("").trim();
        if is_index(h) || is_manifest(h) {
            return Some(h.to_string());
        }
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        media_type: Option<String>,
        manifests: Option<serde_json::Value>,
        config: Option<serde_json::Value>,
    }
    let p: Probe = serde_json::from_slice(body).ok()?;
    if let Some(mt) = p.media_type {
        return Some(mt);
    }
    if p.manifests.is_some() {
        Some(MT_OCI_INDEX.to_string())
    } else if p.config.is_some() {
        Some(MT_OCI_MANIFEST.to_string())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn platform_parse_and_match() {
        let p = Platform::parse("linux/amd64").unwrap();
        assert_eq!(p.to_string(), "linux/amd64");
        let arm = Platform::parse("linux/arm64/v8").unwrap();
        assert!(!p.matches(&arm));
        assert!(Platform::parse("linux/arm64").unwrap().matches(&arm));
        assert!(Platform::parse("linux").is_none());
        assert!(Platform::parse("a/b/c/d").is_none());
    }

    #[test]
    fn an_index_entry_for_the_node() {
        let entry = |n: &[u8], platform: Option<&str>| Descriptor {
            platform: platform.map(|p| Platform::parse(p).unwrap()),
            ..Descriptor::new(MT_OCI_MANIFEST, n)
        };
        let amd64 = Platform::parse("linux/amd64").unwrap();
        let index = |manifests| Index {
            schema_version: 2,
            media_type: None,
            manifests,
            annotations: BTreeMap::new(),
        };
        let pick = |i: &Index| i.manifest_for(&amd64).map(|d| d.digest.clone());
        // The exact platform before a variant of it, whatever the order.
        let i = index(vec![
            entry(b"arm", Some("linux/arm64")),
            entry(b"v3", Some("linux/amd64/v3")),
            entry(b"plain", Some("linux/amd64")),
        ]);
        assert_eq!(pick(&i), Some(Digest::of(b"plain")));
        // A variant when that is all there is.
        let i = index(vec![entry(b"v3", Some("linux/amd64/v3"))]);
        assert_eq!(pick(&i), Some(Digest::of(b"v3")));
        // An entry naming no platform, after any that names the node's.
        let i = index(vec![entry(b"any", None)]);
        assert_eq!(pick(&i), Some(Digest::of(b"any")));
        let i = index(vec![
            entry(b"any", None),
            entry(b"plain", Some("linux/amd64")),
        ]);
        assert_eq!(pick(&i), Some(Digest::of(b"plain")));
        // Another platform only: none.
        let i = index(vec![entry(b"arm", Some("linux/arm64"))]);
        assert_eq!(pick(&i), None);
    }

    #[test]
    fn sniffs_documents() {
        let idx = br#"{"schemaVersion":2,"manifests":[]}"#;
        assert_eq!(sniff_media_type(None, idx).unwrap(), MT_OCI_INDEX);
        assert_eq!(
            sniff_media_type(
                Some("application/vnd.docker.distribution.manifest.v2+json; charset=utf-8"),
                b"{}"
            )
            .unwrap(),
            MT_DOCKER_MANIFEST
        );
    }
}

//! Offline import of images into the store, for nodes that cannot reach a registry:
//! an OCI image layout (directory or tarball) or a `docker save` archive, either possibly
//! gzip- or zstd-compressed.
//!
//! Every regular file of an archive streams into the content store under its own digest;
//! the layout's documents are then resolved exactly as a pull resolves them, layers are
//! unpacked and checked against the config's diff IDs, and records are written. Blobs that
//! end up unreferenced are garbage-collected.

use crate::digest::Digest;
use crate::error::{ImageError, Result};
use crate::oci::{self, Descriptor, ImageConfig, Index, Manifest, Platform};
use crate::reference::Reference;
use crate::store::{ImageRecord, ImageStore};
use serde::Deserialize;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

pub struct ImportOptions {
    /// The platform to pick from multi-platform indexes.
    pub platform: Platform,
    /// A name for the image when the archive carries none (or in addition to its names).
    pub tag: Option<String>,
}

fn bad(path: &Path, reason: impl Into<String>) -> ImageError {
    ImageError::Import {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Files of the archive: name (normalised, relative) -> digest of content in the store.
struct Files {
    by_name: HashMap<String, Digest>,
}

fn normalise(p: &Path) -> Option<String> {
    let mut parts = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => parts.push(s.to_str()?.to_string()),
            Component::CurDir | Component::RootDir => {}
            _ => return None,
        }
    }
    Some(parts.join("/"))
}

fn ingest_reader<R: Read>(store: &ImageStore, mut r: R, what: &str) -> Result<Digest> {
    let mut w = store.blob_writer()?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut hasher = crate::digest::Hashing::new(std::io::sink());
    loop {
        let n = r
            .read(&mut buf)
            .map_err(|e| ImageError::io("read archive", PathBuf::from(what))(e))?;
        if n == 0 {
            break;
        }
        std::io::Write::write_all(&mut hasher, &buf[..n]).map_err(ImageError::io("hash", what))?;
        w.write_chunk(&buf[..n])?;
    }
    let (d, n, _) = hasher.finish();
    if store.has_blob(&d) {
        return Ok(d);
    }
    w.commit(what, &d, Some(n))?;
    Ok(d)
}

fn ingest_tar(store: &ImageStore, path: &Path) -> Result<Files> {
    let f = File::open(path).map_err(ImageError::io("open", path))?;
    let r = crate::store::layer_reader(f).map_err(ImageError::io("read", path))?;
    let mut ar = tar::Archive::new(r);
    let mut by_name = HashMap::new();
    for e in ar.entries().map_err(ImageError::io("read archive", path))? {
        let e = e.map_err(ImageError::io("read archive", path))?;
        if !e.header().entry_type().is_file() {
            continue;
        }
        let name = e
            .path()
            .ok()
            .and_then(|p| normalise(&p))
            .ok_or_else(|| bad(path, "archive has an entry with an unusable name"))?;
        let d = ingest_reader(store, e, &name)?;
        by_name.insert(name, d);
    }
    Ok(Files { by_name })
}

fn ingest_dir(store: &ImageStore, dir: &Path) -> Result<Files> {
    let mut by_name = HashMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).map_err(ImageError::io("list", &p))? {
            let e = e.map_err(ImageError::io("list", &p))?;
            let ft = e.file_type().map_err(ImageError::io("stat", e.path()))?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let rel = e
                    .path()
                    .strip_prefix(dir)
                    .map(Path::to_path_buf)
                    .unwrap_or_default();
                let name = normalise(&rel).ok_or_else(|| bad(dir, "unusable file name"))?;
                let f = File::open(e.path()).map_err(ImageError::io("open", e.path()))?;
                let d = ingest_reader(store, f, &name)?;
                by_name.insert(name, d);
            }
        }
    }
    Ok(Files { by_name })
}

/// Imports every image of the archive or layout at `path`. Returns the records written.
pub fn import(store: &ImageStore, path: &Path, opts: &ImportOptions) -> Result<Vec<ImageRecord>> {
    // Keeps a starting vesseld from garbage-collecting what we ingest before it is recorded.
    let _import = store.import_lock()?;
    let meta = std::fs::metadata(path).map_err(ImageError::io("stat", path))?;
    let files = if meta.is_dir() {
        ingest_dir(store, path)?
    } else {
        ingest_tar(store, path)?
    };
    let res = if files.by_name.contains_key("manifest.json") {
        import_docker(store, path, &files, opts)
    } else if files.by_name.contains_key("index.json") {
        import_oci(store, path, &files, opts)
    } else {
        Err(bad(
            path,
            "neither an OCI image layout (index.json) nor a docker-archive (manifest.json)",
        ))
    };
    // Whatever happened, drop what we ingested and no image references (archive files we did
    // not need, or everything when the import failed). Only our own files: a running vesseld
    // may be pulling into the same store.
    let ours: Vec<Digest> = files.by_name.values().cloned().collect();
    store.remove_unreferenced_blobs(&ours)?;
    res
}

fn read_json<T: for<'de> Deserialize<'de>>(
    store: &ImageStore,
    path: &Path,
    d: &Digest,
    what: &str,
) -> Result<T> {
    let data = store.read_blob(d)?;
    serde_json::from_slice(&data).map_err(|e| bad(path, format!("unreadable {what}: {e}")))
}

fn oci_blob(store: &ImageStore, path: &Path, files: &Files, d: &Digest) -> Result<()> {
    // Layout blobs are named by digest: the content we stored must be exactly that.
    let name = format!("blobs/sha256/{}", d.hex());
    match files.by_name.get(&name) {
        Some(actual) if actual == d => Ok(()),
        Some(actual) => Err(ImageError::DigestMismatch {
            what: format!("{} in {}", name, path.display()),
            expected: d.clone(),
            actual: actual.clone(),
        }),
        None if store.has_blob(d) => Ok(()),
        None => Err(bad(path, format!("blob {d} is missing from the layout"))),
    }
}

fn import_oci(
    store: &ImageStore,
    path: &Path,
    files: &Files,
    opts: &ImportOptions,
) -> Result<Vec<ImageRecord>> {
    let index: Index = read_json(store, path, &files.by_name["index.json"], "index.json")?;
    let mut out = Vec::new();
    for desc in &index.manifests {
        let name = desc
            .annotations
            .get("io.containerd.image.name")
            .or_else(|| desc.annotations.get("org.opencontainers.image.ref.name"))
            .cloned();
        oci_blob(store, path, files, &desc.digest)?;
        let reference = name.clone().unwrap_or_else(|| desc.digest.to_string());
        let (manifest_desc, top) = if oci::is_index(&desc.media_type) {
            let inner: Index = read_json(store, path, &desc.digest, "index")?;
            let chosen = inner.choose(&opts.platform, &reference)?.clone();
            oci_blob(store, path, files, &chosen.digest)?;
            (chosen, desc.digest.clone())
        } else if oci::is_manifest(&desc.media_type) {
            (desc.clone(), desc.digest.clone())
        } else {
            continue;
        };
        let manifest: Manifest = read_json(store, path, &manifest_desc.digest, "manifest")?;
        oci_blob(store, path, files, &manifest.config.digest)?;
        let config: ImageConfig = read_json(store, path, &manifest.config.digest, "image config")?;
        // An index's choice, or a manifest the layout lists itself (docker 25's and skopeo's
        // shape): either way, one for the node's platform.
        config.check_index_entry(&manifest_desc, &opts.platform, &reference)?;
        for l in &manifest.layers {
            oci_blob(store, path, files, &l.digest)?;
        }
        // A ref.name may be a full reference or just a tag.
        let mut names = Vec::new();
        if let Some(n) = name {
            match Reference::parse(&n) {
                Ok(r) if n.contains('/') || n.contains(':') || opts.tag.is_none() => names.push(r),
                _ => {}
            }
        }
        if let Some(t) = &opts.tag {
            names.push(Reference::parse(t)?);
        }
        out.push(finish(
            store,
            path,
            (manifest_desc, &manifest, &config),
            &names,
            Some(&top),
        )?);
    }
    if out.is_empty() {
        return Err(bad(path, "the layout's index lists no image manifest"));
    }
    Ok(out)
}

fn import_docker(
    store: &ImageStore,
    path: &Path,
    files: &Files,
    opts: &ImportOptions,
) -> Result<Vec<ImageRecord>> {
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Entry {
        config: String,
        #[serde(default)]
        repo_tags: Option<Vec<String>>,
        layers: Vec<String>,
    }
    let entries: Vec<Entry> = read_json(
        store,
        path,
        &files.by_name["manifest.json"],
        "manifest.json",
    )?;
    let lookup = |n: &str| -> Result<Digest> {
        let key =
            normalise(Path::new(n)).ok_or_else(|| bad(path, format!("bad file name {n:?}")))?;
        files
            .by_name
            .get(&key)
            .cloned()
            .ok_or_else(|| bad(path, format!("{n} is listed in manifest.json but missing")))
    };
    let mut out = Vec::new();
    for e in entries {
        let cfg_digest = lookup(&e.config)?;
        let cfg_bytes = store.read_blob(&cfg_digest)?;
        let config: ImageConfig = serde_json::from_slice(&cfg_bytes)
            .map_err(|e| bad(path, format!("unreadable image config: {e}")))?;
        let mut layers = Vec::new();
        for l in &e.layers {
            let d = lookup(l)?;
            let size = std::fs::metadata(store.blob_path(&d))
                .map_err(ImageError::io("stat", store.blob_path(&d)))?
                .len();
            let mut head = [0u8; 4];
            let n = File::open(store.blob_path(&d))
                .and_then(|mut f| f.read(&mut head))
                .map_err(ImageError::io("read", store.blob_path(&d)))?;
            let mt = if n >= 2 && head[..2] == [0x1f, 0x8b] {
                oci::MT_OCI_LAYER_GZIP
            } else if n >= 4 && head == [0x28, 0xb5, 0x2f, 0xfd] {
                oci::MT_OCI_LAYER_ZSTD
            } else {
                oci::MT_OCI_LAYER
            };
            layers.push(Descriptor {
                media_type: mt.to_string(),
                digest: d,
                size,
                platform: None,
                annotations: Default::default(),
                urls: vec![],
            });
        }
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(oci::MT_OCI_MANIFEST.to_string()),
            config: Descriptor {
                media_type: oci::MT_OCI_CONFIG.to_string(),
                digest: cfg_digest,
                size: cfg_bytes.len() as u64,
                platform: None,
                annotations: Default::default(),
                urls: vec![],
            },
            layers,
            annotations: Default::default(),
        };
        let mbytes = serde_json::to_vec(&manifest).map_err(|e| bad(path, e.to_string()))?;
        let md = store.put_blob("manifest", &mbytes, None)?;
        let mdesc = Descriptor {
            media_type: oci::MT_OCI_MANIFEST.to_string(),
            digest: md,
            size: mbytes.len() as u64,
            platform: None,
            annotations: Default::default(),
            urls: vec![],
        };
        let reference = e.repo_tags.as_ref().and_then(|t| t.first()).cloned();
        config.check_index_entry(
            &mdesc,
            &opts.platform,
            reference.as_deref().unwrap_or(&e.config),
        )?;
        let mut names = Vec::new();
        for t in e.repo_tags.unwrap_or_default() {
            names.push(Reference::parse(&t)?);
        }
        if let Some(t) = &opts.tag {
            names.push(Reference::parse(t)?);
        }
        // A docker archive has no registry digest: the manifest we made up is not one.
        out.push(finish(
            store,
            path,
            (mdesc, &manifest, &config),
            &names,
            None,
        )?);
    }
    if out.is_empty() {
        return Err(bad(path, "manifest.json lists no image"));
    }
    Ok(out)
}

fn finish(
    store: &ImageStore,
    path: &Path,
    (manifest_desc, manifest, config): (Descriptor, &Manifest, &ImageConfig),
    names: &[Reference],
    registry_digest: Option<&Digest>,
) -> Result<ImageRecord> {
    if config.rootfs.diff_ids.len() != manifest.layers.len() {
        return Err(bad(
            path,
            format!(
                "manifest has {} layers but config lists {} diff IDs",
                manifest.layers.len(),
                config.rootfs.diff_ids.len()
            ),
        ));
    }
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    for (i, (l, diff)) in manifest
        .layers
        .iter()
        .zip(&config.rootfs.diff_ids)
        .enumerate()
    {
        if !store.has_layer(diff) {
            let lowers = config.rootfs.diff_ids[..i]
                .iter()
                .rev()
                .map(|d| store.layer_path(d))
                .collect();
            store.unpack_layer_blob(&l.digest, diff, lowers, Some(written.clone()))?;
        }
    }
    let rec = ImageRecord::new(
        manifest_desc,
        manifest,
        config,
        names.iter().filter_map(|r| r.repo_tag()).collect(),
        match registry_digest {
            Some(d) => names.iter().map(|r| r.repo_digest(d)).collect(),
            None => vec![],
        },
    );
    // The index blob (if any) must survive GC: it is referenced through repo_digests.
    let rec = store.commit_image(rec)?;
    tracing::info!(image = %rec.id, tags = ?rec.repo_tags, "import: image recorded");
    Ok(rec)
}

//! The on-disk image store.
//!
//! ```text
//! <root>/blobs/sha256/<hex>   content-addressed blobs (manifests, configs, compressed layers)
//! <root>/layers/<hex>         unpacked layers, named by diff ID, used as overlayfs lower dirs
//! <root>/records/<hex>.json   one record per image, named by image ID (config digest)
//! <root>/snapshots/<id>/      container root filesystems (see `snapshot`)
//! <root>/erofs/<hex>.img      EROFS images of unpacked layers for VM pods (see `erofs`)
//! <root>/tmp/                 work in progress: `<pid>.<tag>.<n>.tmp`, removed at start if the pid is gone
//! <root>/lock                 flock taken for every change of records, so `vesseld image import`
//!                             and a running `vesseld` can share the store
//! ```
//! Every blob is verified against its digest before it is renamed into place; every layer is
//! unpacked into `tmp/` and renamed into place only when its diff ID matched; records are written
//! atomically. A crash at any point leaves debris only in `tmp/`, which the next start removes.

use crate::digest::{Digest, Hashing};
use crate::error::{ImageError, Result};
use crate::fsutil;
use crate::oci::{Descriptor, RunConfig};
use crate::reference::Reference;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// One layer of an image: the diff ID names the unpacked directory, the blob the bytes it
/// came from (absent for layers imported from an uncompressed archive and then dropped).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LayerInfo {
    pub diff_id: Digest,
    pub blob: Descriptor,
}

/// What the store knows about one image.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageRecord {
    /// The image ID: the digest of its config blob.
    pub id: Digest,
    /// Fully qualified tags, `docker.io/library/busybox:latest`.
    pub repo_tags: Vec<String>,
    /// Fully qualified digests, `docker.io/library/busybox@sha256:...` (manifest or index).
    pub repo_digests: Vec<String>,
    /// The platform manifest this image was resolved to.
    pub manifest: Descriptor,
    /// The config blob.
    pub config: Descriptor,
    pub layers: Vec<LayerInfo>,
    /// `os/arch[/variant]` of the image config.
    pub platform: String,
    /// The runtime defaults of the image config (user, env, entrypoint, cmd, ...).
    #[serde(default)]
    pub run_config: RunConfig,
    /// Bytes of the image's content: config plus layer blobs, as a registry counts it.
    pub size: u64,
    /// Unix seconds of the last pull or import.
    pub pulled_at: i64,
    #[serde(default)]
    pub pinned: bool,
    /// A checkpoint image (its one layer holds a CheckpointContainer archive's files): the
    /// container it was taken of, from the manifest annotation CRI-O and the checkpoint
    /// tools use ([`CHECKPOINT_ANNOTATION`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_of: Option<String>,
}

/// The manifest annotation that marks a checkpoint image (`buildah config --annotation`),
/// naming the checkpointed container.
pub const CHECKPOINT_ANNOTATION: &str = "io.kubernetes.cri-o.annotations.checkpoint.name";

impl ImageRecord {
    /// A record for the image `manifest` describes (its config parsed as `config`), named by
    /// `repo_tags` and `repo_digests`.
    pub fn new(
        manifest_desc: Descriptor,
        manifest: &crate::oci::Manifest,
        config: &crate::oci::ImageConfig,
        repo_tags: Vec<String>,
        repo_digests: Vec<String>,
    ) -> ImageRecord {
        let mut platform = format!("{}/{}", config.os, config.architecture);
        if let Some(v) = &config.variant {
            platform.push('/');
            platform.push_str(v);
        }
        ImageRecord {
            id: manifest.config.digest.clone(),
            repo_tags,
            repo_digests,
            manifest: manifest_desc,
            config: manifest.config.clone(),
            layers: manifest
                .layers
                .iter()
                .zip(&config.rootfs.diff_ids)
                .map(|(b, d)| LayerInfo {
                    diff_id: d.clone(),
                    blob: b.clone(),
                })
                .collect(),
            platform,
            run_config: config.config.clone().unwrap_or_default(),
            size: manifest.config.size + manifest.layers.iter().map(|l| l.size).sum::<u64>(),
            pulled_at: chrono::Utc::now().timestamp(),
            pinned: false,
            checkpoint_of: manifest.annotations.get(CHECKPOINT_ANNOTATION).cloned(),
        }
    }

    /// Whether `reference` (already normalised) names this image by tag or digest.
    pub fn matches(&self, r: &Reference) -> bool {
        if let Some(d) = &r.digest {
            return self.repo_digests.contains(&r.repo_digest(d));
        }
        match r.repo_tag() {
            Some(t) => self.repo_tags.contains(&t),
            None => false,
        }
    }
}

/// Counters for tests and metrics.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Blobs fetched and committed (a blob already present is not counted).
    pub blobs_committed: AtomicU64,
    /// Layers unpacked (a layer already present is not counted).
    pub layers_unpacked: AtomicU64,
    /// EROFS layer images built (see `erofs`).
    pub erofs_built: AtomicU64,
}

/// Async locks keyed by name, so that concurrent pulls share one download of each blob.
#[derive(Default)]
pub struct KeyedLocks {
    map: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl KeyedLocks {
    pub async fn lock(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            if map.len() > 256 {
                map.retain(|_, w| w.strong_count() > 0);
            }
            match map.get(key).and_then(Weak::upgrade) {
                Some(m) => m,
                None => {
                    let m = Arc::new(tokio::sync::Mutex::new(()));
                    map.insert(key.to_string(), Arc::downgrade(&m));
                    m
                }
            }
        };
        m.lock_owned().await
    }
}

pub struct ImageStore {
    root: PathBuf,
    /// Blob digests and diff IDs that in-flight work (pulls) holds; GC keeps them.
    pins: Arc<Mutex<HashMap<String, usize>>>,
    /// Serialises record changes within this process (the flock covers other processes).
    records_mutex: Mutex<()>,
    pub(crate) blob_locks: KeyedLocks,
    pub(crate) layer_locks: KeyedLocks,
    pub(crate) erofs_locks: KeyedLocks,
    pub stats: StoreStats,
    /// What one layer may write when unpacked.
    limits: crate::unpack::UnpackLimits,
    /// The records as last read, with the mtime of `records/` then (see [`ImageStore::list`]).
    records_cache: Mutex<Option<(std::time::SystemTime, Vec<ImageRecord>)>>,
    /// Removes what was moved aside into `tmp/` (removed snapshots) off the caller's path.
    trash: Mutex<Option<std::sync::mpsc::Sender<PathBuf>>>,
}

/// How old `records/`'s mtime must be for a listing to be cached: older than the coarsest
/// timestamp granularity, so that any later change gives the directory a different mtime.
const RECORDS_SETTLED: Duration = Duration::from_millis(50);

/// Counts the bytes read through it (the compressed size of a layer, for the unpack ratio).
struct Counting<R> {
    inner: R,
    n: Arc<std::sync::atomic::AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// A blob being written: hashed as it goes, renamed into place by [`BlobWriter::commit`].
pub struct BlobWriter {
    file: Option<Hashing<File>>,
    tmp: PathBuf,
    final_dir: PathBuf,
    done: bool,
}

impl BlobWriter {
    pub fn write_chunk(&mut self, data: &[u8]) -> Result<()> {
        match &mut self.file {
            Some(f) => f
                .write_all(data)
                .map_err(ImageError::io("write blob", &self.tmp)),
            None => Err(ImageError::io("write blob", &self.tmp)(
                std::io::Error::other("blob writer already finished"),
            )),
        }
    }

    pub fn written(&self) -> u64 {
        self.file.as_ref().map(|f| f.count()).unwrap_or(0)
    }

    /// Verifies size and digest, makes the blob durable and moves it into the store.
    pub fn commit(mut self, what: &str, expected: &Digest, size: Option<u64>) -> Result<()> {
        let tmp = self.tmp.clone();
        let Some(file) = self.file.take() else {
            return Err(ImageError::io("commit blob", &tmp)(std::io::Error::other(
                "blob writer already finished",
            )));
        };
        let (actual, n, f) = file.finish();
        if let Some(size) = size {
            if size != n {
                return Err(ImageError::SizeMismatch {
                    what: what.to_string(),
                    expected: size,
                    actual: n,
                });
            }
        }
        if &actual != expected {
            return Err(ImageError::DigestMismatch {
                what: what.to_string(),
                expected: expected.clone(),
                actual,
            });
        }
        drop(f);
        // No fsync here: the store makes a pull durable once, before the record that makes
        // this blob reachable (see `commit_image`); unreferenced blobs found at start are GC'd.
        let dest = self.final_dir.join(expected.hex());
        fs::rename(&tmp, &dest).map_err(ImageError::io("commit blob", &dest))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Keeps pinned digests from GC while alive.
pub struct PinGuard {
    pins: Arc<Mutex<HashMap<String, usize>>>,
    keys: Vec<String>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let mut m = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        for k in &self.keys {
            if let Some(c) = m.get_mut(k) {
                *c -= 1;
                if *c == 0 {
                    m.remove(k);
                }
            }
        }
    }
}

/// Holds the store's cross-process lock until dropped.
struct StoreLock {
    _file: File,
}

/// Which compression a layer blob uses, from its first bytes (media types lie sometimes).
pub fn layer_reader<'a, R: Read + 'a>(r: R) -> std::io::Result<Box<dyn Read + 'a>> {
    let mut br = BufReader::with_capacity(256 * 1024, r);
    let head = std::io::BufRead::fill_buf(&mut br)?;
    if head.len() >= 2 && head[0] == 0x1f && head[1] == 0x8b {
        Ok(Box::new(flate2::read::MultiGzDecoder::new(br)))
    } else if head.len() >= 4 && head[..4] == [0x28, 0xb5, 0x2f, 0xfd] {
        Ok(Box::new(zstd::stream::read::Decoder::with_buffer(br)?))
    } else {
        Ok(Box::new(br))
    }
}

impl ImageStore {
    /// Opens (creating if needed) the store at `root` and removes debris of dead processes.
    pub fn open(root: impl Into<PathBuf>) -> Result<ImageStore> {
        let root = root.into();
        // Unpacked layers keep the images' setuid bits and device nodes: only root may reach
        // them (moby CVE-2021-41091, containerd CVE-2021-41103).
        fs::create_dir_all(&root).map_err(ImageError::io("create", &root))?;
        fs::set_permissions(&root, fs::Permissions::from_mode(0o700))
            .map_err(ImageError::io("chmod", &root))?;
        for d in [
            "blobs/sha256",
            "layers",
            "records",
            "snapshots",
            "erofs",
            "tmp",
        ] {
            let p = root.join(d);
            fs::create_dir_all(&p).map_err(ImageError::io("create", &p))?;
        }
        let store = ImageStore {
            root,
            pins: Arc::default(),
            records_mutex: Mutex::new(()),
            blob_locks: KeyedLocks::default(),
            layer_locks: KeyedLocks::default(),
            erofs_locks: KeyedLocks::default(),
            stats: StoreStats::default(),
            limits: crate::unpack::UnpackLimits::default(),
            records_cache: Mutex::new(None),
            trash: Mutex::new(None),
        };
        let lock = store.root.join("lock");
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock)
            .map_err(ImageError::io("create", &lock))?;
        let tmp = store.root.join("tmp");
        let n = fsutil::clean_dead_temps(&tmp).map_err(ImageError::io("clean", &tmp))?;
        let recs = store.root.join("records");
        let n2 = fsutil::clean_dead_temps(&recs).map_err(ImageError::io("clean", &recs))?;
        if n + n2 > 0 {
            tracing::info!(
                removed = n + n2,
                "image store: removed debris of interrupted work"
            );
        }
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Sets what one layer may write when unpacked (before the store is shared).
    pub fn set_unpack_limits(&mut self, limits: crate::unpack::UnpackLimits) {
        self.limits = limits;
    }

    fn lock(&self) -> Result<(std::sync::MutexGuard<'_, ()>, StoreLock)> {
        let g = self.records_mutex.lock().unwrap_or_else(|p| p.into_inner());
        let p = self.root.join("lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(ImageError::io("open", &p))?;
        rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| ImageError::io("flock", &p)(e.into()))?;
        Ok((g, StoreLock { _file: f }))
    }

    /// Keeps the named blobs/layers (hex digests) from GC until the guard drops.
    pub fn pin<I: IntoIterator<Item = String>>(&self, keys: I) -> PinGuard {
        let keys: Vec<String> = keys.into_iter().collect();
        let mut m = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        for k in &keys {
            *m.entry(k.clone()).or_default() += 1;
        }
        PinGuard {
            pins: self.pins.clone(),
            keys,
        }
    }

    fn pinned(&self) -> HashSet<String> {
        self.pins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// Deletes those of `candidates` (blob digests) that no image record references.
    pub fn remove_unreferenced_blobs(&self, candidates: &[Digest]) -> Result<usize> {
        let _l = self.lock()?;
        let (blobs, _) = self.referenced()?;
        let pinned = self.pinned();
        let mut n = 0;
        for d in candidates {
            if !blobs.contains(d.hex()) && !pinned.contains(d.hex()) && self.has_blob(d) {
                let p = self.blob_path(d);
                fsutil::remove_any(&p).map_err(ImageError::io("remove", &p))?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// For the daemon at start: blobs and layers that no record references may be the
    /// unsynced work of a pull a crash interrupted (content is only made durable together
    /// with its record), so they go. Skipped while an offline import holds the store.
    pub fn collect_crash_leftovers(&self) -> Result<()> {
        if let Some(_import) = self.try_import_lock()? {
            // No import runs and this process has not started any work: whatever is in tmp
            // is debris of a crash, even where its owner's pid was reused since (an unpack
            // cut short by a crash could leave gigabytes there).
            let tmp = self.tmp_dir();
            let mut n = 0;
            if let Ok(rd) = fs::read_dir(&tmp) {
                for e in rd.flatten() {
                    let name = e.file_name();
                    let ours = name
                        .to_str()
                        .and_then(fsutil::temp_owner)
                        .is_some_and(|pid| pid == std::process::id() as i32);
                    if !ours {
                        fsutil::remove_any(&e.path())
                            .map_err(ImageError::io("remove", &e.path()))?;
                        n += 1;
                    }
                }
            }
            if n > 0 {
                tracing::info!(removed = n, dir = %tmp.display(), "image store: removed interrupted downloads and unpacks");
            }
            // The import lock is held here; the store's is taken after it, as an import does.
            let _l = self.lock()?;
            self.sweep(|| {})?;
        }
        Ok(())
    }

    /// Exclusive lock held by an offline import for its whole run (None: someone holds it).
    pub fn try_import_lock(&self) -> Result<Option<File>> {
        let f = self.open_import_lock()?;
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(f)),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(ImageError::io("flock", self.root.join("import.lock"))(
                e.into(),
            )),
        }
    }

    /// Waits for the import lock.
    pub fn import_lock(&self) -> Result<File> {
        let f = self.open_import_lock()?;
        rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| ImageError::io("flock", self.root.join("import.lock"))(e.into()))?;
        Ok(f)
    }

    fn open_import_lock(&self) -> Result<File> {
        let p = self.root.join("import.lock");
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(ImageError::io("open", &p))
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    // ---- blobs ----

    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(d.hex())
    }

    pub fn has_blob(&self, d: &Digest) -> bool {
        self.blob_path(d).exists()
    }

    pub fn read_blob(&self, d: &Digest) -> Result<Vec<u8>> {
        let p = self.blob_path(d);
        fs::read(&p).map_err(ImageError::io("read blob", &p))
    }

    /// Starts writing a blob; nothing is visible in the store until `commit`.
    pub fn blob_writer(&self) -> Result<BlobWriter> {
        let tmp = fsutil::temp_path(&self.tmp_dir(), "blob");
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(ImageError::io("create", &tmp))?;
        Ok(BlobWriter {
            file: Some(Hashing::new(f)),
            tmp,
            final_dir: self.root.join("blobs/sha256"),
            done: false,
        })
    }

    /// Stores a small blob held in memory, verified against `expected` when given.
    pub fn put_blob(&self, what: &str, data: &[u8], expected: Option<&Digest>) -> Result<Digest> {
        let d = Digest::of(data);
        if let Some(e) = expected {
            if e != &d {
                return Err(ImageError::DigestMismatch {
                    what: what.to_string(),
                    expected: e.clone(),
                    actual: d,
                });
            }
        }
        if self.has_blob(&d) {
            return Ok(d);
        }
        let mut w = self.blob_writer()?;
        w.write_chunk(data)?;
        w.commit(what, &d, Some(data.len() as u64))?;
        Ok(d)
    }

    // ---- layers ----

    pub fn layer_path(&self, diff_id: &Digest) -> PathBuf {
        self.root.join("layers").join(diff_id.hex())
    }

    pub fn has_layer(&self, diff_id: &Digest) -> bool {
        self.layer_path(diff_id).is_dir()
    }

    /// Unpacks an uncompressed/gzip/zstd layer stream into `layers/<diff_id>`, checking the
    /// diff ID. Blocking: call from a blocking thread. `lowers` are the image's lower layers,
    /// top-most first, for hard links into them.
    pub fn unpack_layer_from<R: Read>(
        &self,
        reader: R,
        diff_id: &Digest,
        lowers: Vec<PathBuf>,
        image_written: Option<Arc<std::sync::atomic::AtomicU64>>,
    ) -> Result<()> {
        let dest = self.layer_path(diff_id);
        if dest.is_dir() {
            return Ok(());
        }
        let tmp = fsutil::temp_path(&self.tmp_dir(), "layer");
        fs::create_dir(&tmp).map_err(ImageError::io("create", &tmp))?;
        let res = (|| {
            let compressed_read = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let counted = Counting {
                inner: reader,
                n: compressed_read.clone(),
            };
            let r = layer_reader(counted).map_err(|e| ImageError::Unpack {
                layer: diff_id.clone(),
                source: crate::unpack::UnpackError::Read(e),
            })?;
            let opts = crate::unpack::UnpackOptions {
                lowers,
                same_owner: rustix::process::geteuid().is_root(),
                skip_sync: true,
                limits: self.limits,
                compressed_read: Some(compressed_read),
                image_written,
            };
            let stats = crate::unpack::unpack_layer(r, &tmp, &opts).map_err(|source| {
                ImageError::Unpack {
                    layer: diff_id.clone(),
                    source,
                }
            })?;
            if &stats.diff_id != diff_id {
                return Err(ImageError::DigestMismatch {
                    what: "uncompressed layer (diff ID)".to_string(),
                    expected: diff_id.clone(),
                    actual: stats.diff_id,
                });
            }
            match fs::rename(&tmp, &dest) {
                Ok(()) => {}
                // Another process finished the same layer first: theirs is as good as ours.
                Err(_) if dest.is_dir() => {
                    let _ = fsutil::remove_any(&tmp);
                }
                Err(e) => return Err(ImageError::io("commit layer", &dest)(e)),
            }
            self.stats.layers_unpacked.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })();
        if res.is_err() {
            let _ = fsutil::remove_any(&tmp);
        }
        res
    }

    /// Unpacks a stored layer blob. Blocking.
    pub fn unpack_layer_blob(
        &self,
        blob: &Digest,
        diff_id: &Digest,
        lowers: Vec<PathBuf>,
        image_written: Option<Arc<std::sync::atomic::AtomicU64>>,
    ) -> Result<()> {
        let p = self.blob_path(blob);
        let f = File::open(&p).map_err(ImageError::io("open blob", &p))?;
        self.unpack_layer_from(f, diff_id, lowers, image_written)
    }

    /// The unpacked layer directories of an image, bottom-most first, each once
    /// ([`crate::snapshot::distinct_layers`]).
    pub fn layer_dirs(&self, rec: &ImageRecord) -> Vec<PathBuf> {
        crate::snapshot::distinct_layers(rec.layers.iter().map(|l| self.layer_path(&l.diff_id)))
    }

    // ---- records ----

    fn record_path(&self, id: &Digest) -> PathBuf {
        self.root.join("records").join(format!("{}.json", id.hex()))
    }

    /// Every image record, sorted by ID.
    /// Every image record. Served from memory while `records/` is unchanged: every change of
    /// a record (here or by `vesseld image import`, another process) creates, renames or
    /// removes a file in it, which changes its mtime; a listing is only kept once that mtime
    /// has settled ([`RECORDS_SETTLED`]), so no change can share its timestamp.
    pub fn list(&self) -> Result<Vec<ImageRecord>> {
        let dir = self.root.join("records");
        let mtime = fs::metadata(&dir)
            .and_then(|m| m.modified())
            .map_err(ImageError::io("stat", &dir))?;
        let mut cache = self.records_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((m, recs)) = cache.as_ref() {
            if *m == mtime {
                return Ok(recs.clone());
            }
        }
        let recs = self.read_records(&dir)?;
        let settled = std::time::SystemTime::now()
            .duration_since(mtime)
            .is_ok_and(|age| age > RECORDS_SETTLED);
        *cache = settled.then(|| (mtime, recs.clone()));
        Ok(recs)
    }

    /// Deletes `path` (moved aside under `tmp/` by the caller) on a background thread, one
    /// for the store, so that removals do not wait for the filesystem (a freed extent can
    /// cost a synchronous discard). Without that thread, at once.
    pub(crate) fn discard(&self, path: PathBuf) {
        let mut trash = self.trash.lock().unwrap_or_else(|p| p.into_inner());
        if trash.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<PathBuf>();
            let spawned = std::thread::Builder::new()
                .name("vessel-trash".into())
                .spawn(move || {
                    for p in rx {
                        if let Err(e) = fsutil::remove_any(&p) {
                            tracing::warn!(path = %p.display(), error = %e, "image store: removing");
                        }
                    }
                });
            if spawned.is_ok() {
                *trash = Some(tx);
            }
        }
        let path = match trash.as_ref() {
            Some(tx) => match tx.send(path) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(p)) => p,
            },
            None => path,
        };
        if let Err(e) = fsutil::remove_any(&path) {
            tracing::warn!(path = %path.display(), error = %e, "image store: removing");
        }
    }

    fn read_records(&self, dir: &Path) -> Result<Vec<ImageRecord>> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).map_err(ImageError::io("list", dir))? {
            let e = e.map_err(ImageError::io("list", dir))?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if !name.ends_with(".json") {
                continue;
            }
            let p = e.path();
            let data = match fs::read(&p) {
                Ok(d) => d,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ImageError::io("read", &p)(e)),
            };
            match serde_json::from_slice::<ImageRecord>(&data) {
                Ok(r) => out.push(r),
                Err(err) => {
                    tracing::warn!(path = %p.display(), %err, "image store: skipping unreadable record")
                }
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    pub fn get(&self, id: &Digest) -> Result<Option<ImageRecord>> {
        let p = self.record_path(id);
        match fs::read(&p) {
            Ok(d) => serde_json::from_slice(&d)
                .map(Some)
                .map_err(|e| ImageError::BadImage {
                    reference: id.to_string(),
                    reason: format!("unreadable record {}: {e}", p.display()),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ImageError::io("read", &p)(e)),
        }
    }

    /// Finds an image by ID (`sha256:<hex>` or bare hex), by tag, by repo digest, or by a
    /// unique prefix of its ID (as `crictl images` prints IDs) that names no tag.
    pub fn find(&self, query: &str) -> Result<Option<ImageRecord>> {
        let q = query.trim();
        if let Ok(d) = q.parse::<Digest>() {
            return self.get(&d);
        }
        if q.len() == 64 && q.bytes().all(|c| c.is_ascii_hexdigit()) {
            if let Ok(d) = format!("sha256:{}", q.to_ascii_lowercase()).parse::<Digest>() {
                if let Some(r) = self.get(&d)? {
                    return Ok(Some(r));
                }
            }
        }
        let by_name = match Reference::parse(q) {
            Ok(r) => self.list()?.into_iter().find(|rec| rec.matches(&r)),
            Err(e) => return self.by_id_prefix(q)?.map_or(Err(e.into()), |r| Ok(Some(r))),
        };
        match by_name {
            Some(r) => Ok(Some(r)),
            None => self.by_id_prefix(q),
        }
    }

    /// The one image whose ID starts with `q` (4 to 63 hex digits, `sha256:` optional), as
    /// containerd resolves the short IDs `crictl images` prints (`crictl rmi`, `inspecti`);
    /// none where no image's ID does, [`ImageError::Ambiguous`] where several images' do (as
    /// containerd's digest set answers).
    fn by_id_prefix(&self, q: &str) -> Result<Option<ImageRecord>> {
        let hex = q.strip_prefix("sha256:").unwrap_or(q);
        if !(4..64).contains(&hex.len()) || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let hex = hex.to_ascii_lowercase();
        let mut found: Vec<ImageRecord> = self
            .list()?
            .into_iter()
            .filter(|r| r.id.hex().starts_with(&hex))
            .collect();
        if found.len() > 1 {
            found.sort_by(|a, b| a.id.hex().cmp(b.id.hex()));
            let mut matches: Vec<String> = found
                .iter()
                .take(3)
                .map(|r| {
                    let id = r.id.to_string();
                    format!("{}...", id.get(..27).unwrap_or(&id))
                })
                .collect();
            if found.len() > 3 {
                matches.push(format!("{} more", found.len() - 3));
            }
            return Err(ImageError::Ambiguous {
                prefix: q.to_string(),
                matches: matches.join(", "),
            });
        }
        Ok(found.pop())
    }

    fn write_record(&self, rec: &ImageRecord) -> Result<()> {
        let p = self.record_path(&rec.id);
        let data = serde_json::to_vec_pretty(rec).map_err(|e| ImageError::BadImage {
            reference: rec.id.to_string(),
            reason: format!("serialising record: {e}"),
        })?;
        fsutil::atomic_write(&p, &data).map_err(ImageError::io("write", &p))
    }

    /// Records a pulled or imported image: merges its names into an existing record of the
    /// same ID and moves each tag away from whatever image had it before.
    pub fn commit_image(&self, mut rec: ImageRecord) -> Result<ImageRecord> {
        // The durability barrier: every blob and layer this record points to reaches the disk
        // before the record does. One syncfs instead of an fsync per blob, file and directory.
        let f = File::open(&self.root).map_err(ImageError::io("open", &self.root))?;
        rustix::fs::syncfs(&f).map_err(|e| ImageError::io("syncfs", &self.root)(e.into()))?;
        let _l = self.lock()?;
        for other in self.list()? {
            if other.id == rec.id {
                for t in other.repo_tags {
                    if !rec.repo_tags.contains(&t) {
                        rec.repo_tags.push(t);
                    }
                }
                for d in other.repo_digests {
                    if !rec.repo_digests.contains(&d) {
                        rec.repo_digests.push(d);
                    }
                }
                rec.pinned |= other.pinned;
                continue;
            }
            let before = other.repo_tags.len();
            let mut o = other.clone();
            o.repo_tags.retain(|t| !rec.repo_tags.contains(t));
            if o.repo_tags.len() != before {
                tracing::info!(image = %o.id.short(), "tag moved to image {}", rec.id.short());
                self.write_record(&o)?;
            }
        }
        rec.repo_tags.sort();
        rec.repo_digests.sort();
        self.write_record(&rec)?;
        Ok(rec)
    }

    /// Removes the image a name refers to, whole: by ID, by any one of its tags or by a repo
    /// digest, the image goes with every tag and digest it has (the CRI's RemoveImage
    /// contract, as containerd implements it; kubelet removes by ID).
    ///
    /// Returns the IDs of images deleted. A name that matches nothing is not an error.
    pub fn remove(
        &self,
        query: &str,
        in_use: &dyn Fn(&Digest) -> Option<String>,
    ) -> Result<Vec<Digest>> {
        let q = query.trim();
        let by_id = q.parse::<Digest>().ok().or_else(|| {
            (q.len() == 64)
                .then(|| format!("sha256:{q}").parse::<Digest>().ok())
                .flatten()
        });
        let mut deleted = Vec::new();
        {
            let _l = self.lock()?;
            let victims: Vec<ImageRecord> = if let Some(id) = &by_id {
                self.get(id)?.into_iter().collect()
            } else {
                let named = match Reference::parse(q) {
                    Ok(r) => Ok(self.list()?.into_iter().filter(|x| x.matches(&r)).collect()),
                    Err(e) => Err(e),
                };
                match named {
                    Ok(v) if !Vec::is_empty(&v) => v,
                    Ok(_) => self.by_id_prefix(q)?.into_iter().collect(),
                    Err(e) => match self.by_id_prefix(q)? {
                        Some(r) => vec![r],
                        None => return Err(e.into()),
                    },
                }
            };
            for rec in victims {
                if let Some(users) = in_use(&rec.id) {
                    return Err(ImageError::InUse {
                        reference: q.to_string(),
                        users,
                    });
                }
                let p = self.record_path(&rec.id);
                fs::remove_file(&p).map_err(ImageError::io("remove", &p))?;
                deleted.push(rec.id.clone());
            }
            if !deleted.is_empty() {
                let recs = self.root.join("records");
                fsutil::sync_dir(&recs).map_err(ImageError::io("fsync", &recs))?;
            }
        }
        if !deleted.is_empty() {
            self.gc()?;
        }
        Ok(deleted)
    }

    /// Hex digests of blobs and layers that records and snapshots reference.
    fn referenced(&self) -> Result<(HashSet<String>, HashSet<String>)> {
        let recs = self.list()?;
        let mut blobs: HashSet<String> = HashSet::new();
        let mut layers = self.layers_in_snapshots();
        for r in &recs {
            blobs.insert(r.config.digest.hex().to_string());
            blobs.insert(r.manifest.digest.hex().to_string());
            for l in &r.layers {
                blobs.insert(l.blob.digest.hex().to_string());
                layers.insert(l.diff_id.hex().to_string());
            }
            for d in &r.repo_digests {
                if let Some((_, d)) = d.rsplit_once('@') {
                    if let Ok(d) = d.parse::<Digest>() {
                        blobs.insert(d.hex().to_string());
                    }
                }
            }
        }
        Ok((blobs, layers))
    }

    /// Removes blobs and layers that no image record, snapshot or in-flight pull references.
    /// Not while an import runs (`vesseld image import`, another process): it writes blobs
    /// and layers before the record that references them, and its pins are its own; the
    /// next RemoveImage, failed pull or start collects then.
    pub fn gc(&self) -> Result<(usize, usize)> {
        // The store's lock first: two collections of this process take turns there, and do
        // not take each other for an import (flock locks of two open files conflict within
        // a process too). The import lock is only tried, so the import's order (its lock,
        // then the store's) cannot deadlock with this one.
        let _l = self.lock()?;
        let Some(_import) = self.try_import_lock()? else {
            tracing::info!(
                "image store: an import is running; garbage collection is left for later"
            );
            return Ok((0, 0));
        };
        self.sweep(|| {})
    }

    /// What [`gc`](Self::gc) removes, its caller holding the store's lock; `between` runs
    /// after it read what is referenced and pinned and before it removes anything (a test's
    /// pull pinning a layer then).
    fn sweep(&self, between: impl FnOnce()) -> Result<(usize, usize)> {
        let (mut blobs, mut layers) = self.referenced()?;
        let pinned = self.pinned();
        blobs.extend(pinned.iter().cloned());
        layers.extend(pinned);
        between();
        let mut nb = 0;
        let bdir = self.root.join("blobs/sha256");
        for e in fs::read_dir(&bdir)
            .map_err(ImageError::io("list", &bdir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().to_string();
            if !blobs.contains(&name) && self.remove_unless_pinned(&name, &e.path())? {
                nb += 1;
            }
        }
        let mut nl = 0;
        let ldir = self.root.join("layers");
        for e in fs::read_dir(&ldir)
            .map_err(ImageError::io("list", &ldir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().to_string();
            if !layers.contains(&name) && self.remove_unless_pinned(&name, &e.path())? {
                nl += 1;
            }
        }
        // A layer's EROFS images go with it (an image of a layer that is kept stays).
        let ne = self.gc_erofs(&layers)?;
        if nb + nl + ne > 0 {
            tracing::info!(
                blobs = nb,
                layers = nl,
                erofs = ne,
                "image store: garbage collected"
            );
        }
        Ok((nb, nl))
    }

    /// Removes `path`, a blob, layer or layer image of digest `hex` that a GC found
    /// unreferenced, unless `hex` was pinned since: a pull pins what it reuses and then
    /// checks that it is there, so the check for a pin and the move out of the store are
    /// one step under the pins' lock (the removal of what was moved comes after). Moved
    /// first, so that a crash mid-delete never leaves half a layer under its name. Whether
    /// it was removed.
    pub(crate) fn remove_unless_pinned(&self, hex: &str, path: &Path) -> Result<bool> {
        let tmp = fsutil::temp_path(&self.tmp_dir(), "gc");
        {
            let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
            if pins.contains_key(hex) {
                return Ok(false);
            }
            match fs::rename(path, &tmp) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
                r => r.map_err(ImageError::io("remove", path))?,
            }
        }
        fsutil::remove_any(&tmp).map_err(ImageError::io("remove", &tmp))?;
        Ok(true)
    }

    /// Bytes and inodes the store uses on disk.
    pub fn usage(&self) -> Result<(u64, u64)> {
        fsutil::disk_usage(&self.root).map_err(ImageError::io("measure", &self.root))
    }

    /// (bytes, inodes) the containers' writable layers use: the snapshots directory.
    pub fn snapshots_usage(&self) -> Result<(u64, u64)> {
        let dir = self.snapshots_root();
        match fsutil::disk_usage(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((0, 0)),
            r => r.map_err(ImageError::io("measure", &dir)),
        }
    }

    /// Where container root filesystems (snapshots) live.
    pub fn snapshots_root(&self) -> PathBuf {
        self.root.join("snapshots")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(hex: &str, tag: &str) -> ImageRecord {
        let d = |h: &str| format!("sha256:{h}").parse::<Digest>().unwrap();
        let desc = |h: &str| Descriptor {
            media_type: "application/vnd.oci.image.config.v1+json".into(),
            digest: d(h),
            size: 2,
            platform: None,
            annotations: Default::default(),
            urls: Vec::new(),
        };
        ImageRecord {
            id: d(hex),
            repo_tags: vec![tag.to_string()],
            repo_digests: Vec::new(),
            manifest: desc(&"f".repeat(64)),
            config: desc(hex),
            layers: Vec::new(),
            platform: "linux/amd64".into(),
            run_config: Default::default(),
            size: 2,
            pulled_at: 0,
            pinned: false,
            checkpoint_of: None,
        }
    }

    #[test]
    fn short_ids_as_crictl_prints_them_find_and_remove_one_image() {
        let t = tempfile::tempdir().unwrap();
        let store = ImageStore::open(t.path()).unwrap();
        let a = format!("3f57d9401f8d{}", "a".repeat(52));
        let b = format!("3f57d9401f8e{}", "b".repeat(52));
        store
            .commit_image(record(&a, "docker.io/library/a:1"))
            .unwrap();
        store
            .commit_image(record(&b, "docker.io/library/b:1"))
            .unwrap();
        // The 13 characters `crictl images` prints, with and without the algorithm.
        for q in ["3f57d9401f8da", "sha256:3f57d9401f8da", "3F57D9401F8DA"] {
            let got = store.find(q).unwrap().map(|r| r.id.hex().to_string());
            assert_eq!(got.as_deref(), Some(a.as_str()), "{q}");
        }
        // A prefix of both is refused, naming both; a too short one is none of them.
        for q in ["3f57d9401f8", "sha256:3f57"] {
            let e = store.find(q).unwrap_err();
            assert!(matches!(e, ImageError::Ambiguous { .. }), "{q}: {e}");
            let m = e.to_string();
            assert!(m.contains(&a[..20]) && m.contains(&b[..20]), "{m}");
            let e = store.remove(q, &|_| None).unwrap_err();
            assert!(matches!(e, ImageError::Ambiguous { .. }), "{q}: {e}");
        }
        assert!(store.find("3f5").unwrap().is_none());
        // A tag is a tag first.
        store
            .commit_image(record(
                &"c".repeat(64),
                "docker.io/library/3f57d9401f8e:latest",
            ))
            .unwrap();
        let got = store.find("3f57d9401f8e").unwrap().unwrap();
        assert_eq!(got.id.hex(), "c".repeat(64));
        let gone = store.remove("3f57d9401f8eb", &|_| None).unwrap();
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].hex(), b);
        assert!(store.find(&b).unwrap().is_none());
        assert!(store.find(&a).unwrap().is_some());
        assert!(store.remove("0123456789ab", &|_| None).unwrap().is_empty());
    }

    /// A pull that pins a layer and a blob after a GC read the pins (and then finds them
    /// there, and reuses them) keeps them: the GC checks for a pin again as it removes.
    #[test]
    fn gc_keeps_what_a_pull_pinned_after_it_began() {
        let t = tempfile::tempdir().unwrap();
        let store = ImageStore::open(t.path()).unwrap();
        let layer = Digest::of(b"a layer");
        let kept = store.layer_path(&layer);
        fs::create_dir_all(kept.join("etc")).unwrap();
        let blob = store.put_blob("blob", b"a blob", None).unwrap();
        let gone = Digest::of(b"another layer");
        fs::create_dir_all(store.layer_path(&gone)).unwrap();
        let other = store.put_blob("blob", b"another blob", None).unwrap();
        let mut pins = None;
        let l = store.lock().unwrap();
        let (nb, nl) = store
            .sweep(|| pins = Some(store.pin([layer.hex().to_string(), blob.hex().to_string()])))
            .unwrap();
        drop(l);
        assert_eq!((nb, nl), (1, 1), "only the unpinned pair goes");
        assert!(store.has_layer(&layer) && kept.join("etc").is_dir());
        assert!(store.has_blob(&blob));
        assert!(!store.has_layer(&gone) && !store.has_blob(&other));
        // Nothing of the removal is left in tmp; once unpinned, the pair goes too.
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
        drop(pins);
        // Not while an import (another process, another open store) holds its lock: what
        // it wrote has no record yet.
        let import = ImageStore::open(t.path()).unwrap();
        let lock = import.import_lock().unwrap();
        assert_eq!(store.gc().unwrap(), (0, 0));
        assert!(store.has_layer(&layer) && store.has_blob(&blob));
        drop(lock);
        // Two collections of one process at once take turns (each took the other's import
        // lock for an import's).
        let again = ImageStore::open(t.path()).unwrap();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| store.gc().unwrap());
            let b = s.spawn(|| again.gc().unwrap());
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!((a.0 + b.0, a.1 + b.1), (1, 1), "{a:?} {b:?}");
    }
}

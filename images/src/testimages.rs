//! Deterministic test images, built in memory from Debian's static busybox.
//!
//! Everything here is byte-for-byte reproducible: the same `/bin/busybox` and the same crate
//! versions give the same digests on every run and every machine. Tar entries carry mtime 0,
//! explicit uid/gid/uname/gname and GNU headers; gzip streams carry no mtime or file name;
//! image configs carry the fixed creation time `1970-01-01T00:00:00Z`.
//!
//! These are test fixtures: the helpers panic with a clear message where a fixture cannot be
//! built (no `/bin/busybox`, a compressor failing on in-memory data), and [`LayerBuilder`]
//! deliberately does not validate paths, so that it can write malicious layers.

use crate::digest::Digest;
use crate::oci::{
    Descriptor, ImageConfig, Index, Manifest, Platform, RootFs, RunConfig, MT_OCI_CONFIG,
    MT_OCI_INDEX, MT_OCI_LAYER, MT_OCI_LAYER_GZIP, MT_OCI_LAYER_ZSTD, MT_OCI_MANIFEST,
};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::sync::OnceLock;

/// The creation time written into every test image config.
pub const CREATED: &str = "1970-01-01T00:00:00Z";

/// Where the busybox binary is read from.
pub const BUSYBOX_PATH: &str = "/bin/busybox";

/// `PATH` in the busybox images.
pub const BUSYBOX_PATH_ENV: &str = "PATH=/usr/sbin:/usr/bin:/sbin:/bin";

/// Contents of `/etc/passwd` in the busybox root filesystem.
pub const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
daemon:x:1:1:daemon:/usr/sbin:/bin/false\n\
nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n\
vessel:x:1000:1000:vessel:/home/vessel:/bin/sh\n";

/// Contents of `/etc/group` in the busybox root filesystem (`vessel` is also in `staff`).
pub const GROUP: &str = "root:x:0:\n\
daemon:x:1:\n\
staff:x:50:vessel\n\
nobody:x:65534:\n\
vessel:x:1000:\n";

/// Contents of `/ARCH` in the arm64 image of [`multiarch_index`].
pub const ARM64_MARKER: &[u8] = b"arm64";

/// Media type of the in-toto statement in the attestation entry of [`multiarch_index`].
pub const MT_IN_TOTO: &str = "application/vnd.in-toto+json";

/// One content-addressed blob: a layer, a config, a manifest or an index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub media_type: String,
    pub data: Vec<u8>,
}

impl Blob {
    pub fn new(media_type: &str, data: Vec<u8>) -> Blob {
        Blob {
            media_type: media_type.to_string(),
            data,
        }
    }

    /// The descriptor that references this blob (no platform, no annotations).
    pub fn descriptor(&self) -> Descriptor {
        Descriptor::new(&self.media_type, &self.data)
    }

    pub fn digest(&self) -> Digest {
        Digest::of(&self.data)
    }

    pub fn size(&self) -> u64 {
        self.data.len() as u64
    }
}

/// A single-platform image: manifest, config and (compressed) layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltImage {
    pub manifest: Blob,
    pub config: Blob,
    pub layers: Vec<Blob>,
    /// sha256 of each layer's uncompressed tar, as in the config's `rootfs.diff_ids`.
    pub diff_ids: Vec<Digest>,
}

impl BuiltImage {
    /// The image ID: the digest of the config blob.
    pub fn id(&self) -> Digest {
        self.config.digest()
    }

    pub fn manifest_digest(&self) -> Digest {
        self.manifest.digest()
    }

    /// Config and layers (not the manifest), in the order a push uploads them.
    pub fn blobs(&self) -> impl Iterator<Item = &Blob> {
        std::iter::once(&self.config).chain(self.layers.iter())
    }

    /// The parsed image config. Panics only if `config` was replaced by something that is not
    /// an image config (a test helper misuse).
    pub fn image_config(&self) -> ImageConfig {
        serde_json::from_slice(&self.config.data)
            .unwrap_or_else(|e| panic!("test image config does not parse: {e}"))
    }

    /// The platform recorded in the config.
    pub fn platform(&self) -> Platform {
        let c = self.image_config();
        Platform {
            architecture: c.architecture,
            os: c.os,
            variant: c.variant,
            os_version: None,
        }
    }

    /// The uncompressed tar of layer `i` (decompressed according to its media type).
    pub fn layer_tar(&self, i: usize) -> Vec<u8> {
        decompress(&self.layers[i])
    }
}

/// What a test pushes or imports: one image, or an index over several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Artifact {
    Image(BuiltImage),
    /// `images` holds every manifest the index references, in index order.
    Index {
        index: Blob,
        images: Vec<BuiltImage>,
    },
}

impl Artifact {
    /// The manifest digest of an image, or the index digest.
    pub fn top_digest(&self) -> Digest {
        self.top().digest()
    }

    /// The manifest of an image, or the index.
    pub fn top(&self) -> &Blob {
        match self {
            Artifact::Image(img) => &img.manifest,
            Artifact::Index { index, .. } => index,
        }
    }

    /// Every single-platform image in the artifact.
    pub fn images(&self) -> &[BuiltImage] {
        match self {
            Artifact::Image(img) => std::slice::from_ref(img),
            Artifact::Index { images, .. } => images,
        }
    }

    /// Every blob of the artifact (layers, configs, manifests, then the index), without
    /// duplicates, in a fixed order.
    pub fn all_blobs(&self) -> Vec<&Blob> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for img in self.images() {
            for b in img.blobs().chain(std::iter::once(&img.manifest)) {
                if seen.insert(b.digest()) {
                    out.push(b);
                }
            }
        }
        if let Artifact::Index { index, .. } = self {
            if seen.insert(index.digest()) {
                out.push(index);
            }
        }
        out
    }
}

/// Layer compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Malicious layers for the unpacker's path-traversal defences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EscapeKind {
    /// A regular file named `../../escaped`.
    DotDot,
    /// `evil -> ../../../../tmp`, then a file `evil/escaped`.
    SymlinkParent,
    /// `abs -> /tmp`, then a file `abs/escaped`.
    AbsoluteSymlinkParent,
}

/// Content of the `escaped` files in [`escape_image`] layers.
pub const ESCAPE_MARKER: &[u8] =
    b"vessel escape test: this file must not exist outside the rootfs\n";

const BLOCK: usize = 512;

/// Builds a deterministic tar stream (GNU headers, mtime 0, explicit ownership).
///
/// Entries are written in the order they are added. Paths given to the helpers lose a leading
/// `/`; directories get a trailing `/`. Nothing is validated: `raw_entry` writes any name.
#[derive(Debug, Clone, Default)]
pub struct LayerBuilder {
    out: Vec<u8>,
    mtime: u64,
}

impl LayerBuilder {
    pub fn new() -> LayerBuilder {
        LayerBuilder::default()
    }

    /// Sets the mtime of entries added from now on (default 0).
    pub fn mtime(&mut self, mtime: u64) -> &mut Self {
        self.mtime = mtime;
        self
    }

    /// A directory owned by root.
    pub fn dir(&mut self, path: &str, mode: u32) -> &mut Self {
        self.dir_owned(path, mode, 0, 0)
    }

    pub fn dir_owned(&mut self, path: &str, mode: u32, uid: u64, gid: u64) -> &mut Self {
        let mut name = rel(path).to_string();
        if !name.ends_with('/') {
            name.push('/');
        }
        self.raw_entry(name.as_bytes(), b'5', mode, uid, gid, b"", b"")
    }

    /// A regular file owned by root.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> &mut Self {
        self.file_owned(path, mode, 0, 0, data)
    }

    pub fn file_owned(
        &mut self,
        path: &str,
        mode: u32,
        uid: u64,
        gid: u64,
        data: &[u8],
    ) -> &mut Self {
        self.raw_entry(rel(path).as_bytes(), b'0', mode, uid, gid, b"", data)
    }

    /// A symlink owned by root; `target` is written as given (absolute targets stay absolute).
    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.raw_entry(
            rel(path).as_bytes(),
            b'2',
            0o777,
            0,
            0,
            target.as_bytes(),
            b"",
        )
    }

    /// A hard link to `target`, an earlier entry of the archive.
    pub fn hardlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.raw_entry(
            rel(path).as_bytes(),
            b'1',
            0o755,
            0,
            0,
            rel(target).as_bytes(),
            b"",
        )
    }

    /// An OCI whiteout for `path`: the entry `<dir>/.wh.<name>`.
    pub fn whiteout(&mut self, path: &str) -> &mut Self {
        let p = rel(path).trim_end_matches('/');
        let name = match p.rsplit_once('/') {
            Some((dir, base)) => format!("{dir}/.wh.{base}"),
            None => format!(".wh.{p}"),
        };
        self.raw_entry(name.as_bytes(), b'0', 0o644, 0, 0, b"", b"")
    }

    /// An opaque-directory marker: the entry `<dir>/.wh..wh..opq`.
    pub fn opaque(&mut self, dir: &str) -> &mut Self {
        let d = rel(dir).trim_end_matches('/');
        let name = if d.is_empty() {
            ".wh..wh..opq".to_string()
        } else {
            format!("{d}/.wh..wh..opq")
        };
        self.raw_entry(name.as_bytes(), b'0', 0o644, 0, 0, b"", b"")
    }

    /// Any entry, written exactly as given: `typeflag` is the tar type byte (`b'0'` file,
    /// `b'1'` hard link, `b'2'` symlink, `b'5'` directory, ...). Names or link names over
    /// 100 bytes get a GNU long-name record first.
    #[allow(clippy::too_many_arguments)]
    pub fn raw_entry(
        &mut self,
        name: &[u8],
        typeflag: u8,
        mode: u32,
        uid: u64,
        gid: u64,
        link_name: &[u8],
        data: &[u8],
    ) -> &mut Self {
        if name.len() > 100 {
            self.long_record(b'L', name);
        }
        if link_name.len() > 100 {
            self.long_record(b'K', link_name);
        }
        let h = header(&HeaderFields {
            name,
            typeflag,
            mode,
            uid,
            gid,
            size: data.len() as u64,
            mtime: self.mtime,
            link_name,
            uname: user_name(uid),
            gname: group_name(gid),
        });
        self.out.extend_from_slice(&h);
        self.push_data(data);
        self
    }

    /// A GNU long-name (`L`) or long-link-name (`K`) record for the next entry.
    fn long_record(&mut self, typeflag: u8, value: &[u8]) {
        let mut data = value.to_vec();
        data.push(0);
        let h = header(&HeaderFields {
            name: b"././@LongLink",
            typeflag,
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: data.len() as u64,
            mtime: 0,
            link_name: b"",
            uname: "root",
            gname: "root",
        });
        self.out.extend_from_slice(&h);
        self.push_data(&data);
    }

    fn push_data(&mut self, data: &[u8]) {
        self.out.extend_from_slice(data);
        let pad = (BLOCK - data.len() % BLOCK) % BLOCK;
        self.out.resize(self.out.len() + pad, 0);
    }

    /// The finished, uncompressed tar (with the two zero end-of-archive blocks).
    pub fn finish(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.out.len() + 2 * BLOCK);
        out.extend_from_slice(&self.out);
        out.resize(out.len() + 2 * BLOCK, 0);
        out
    }
}

fn rel(path: &str) -> &str {
    path.trim_start_matches('/')
}

fn user_name(uid: u64) -> &'static str {
    match uid {
        0 => "root",
        1 => "daemon",
        1000 => "vessel",
        65534 => "nobody",
        _ => "",
    }
}

fn group_name(gid: u64) -> &'static str {
    match gid {
        0 => "root",
        1 => "daemon",
        50 => "staff",
        1000 => "vessel",
        65534 => "nobody",
        _ => "",
    }
}

struct HeaderFields<'a> {
    name: &'a [u8],
    typeflag: u8,
    mode: u32,
    uid: u64,
    gid: u64,
    size: u64,
    mtime: u64,
    link_name: &'a [u8],
    uname: &'a str,
    gname: &'a str,
}

/// A GNU tar header block. Over-long names are truncated here; `raw_entry` emits the GNU
/// long-name record before.
fn header(f: &HeaderFields<'_>) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    copy_trunc(&mut h[0..100], f.name);
    numeric(&mut h[100..108], u64::from(f.mode & 0o7777));
    numeric(&mut h[108..116], f.uid);
    numeric(&mut h[116..124], f.gid);
    numeric(&mut h[124..136], f.size);
    numeric(&mut h[136..148], f.mtime);
    h[156] = f.typeflag;
    copy_trunc(&mut h[157..257], f.link_name);
    h[257..263].copy_from_slice(b"ustar ");
    h[263..265].copy_from_slice(b" \0");
    copy_trunc(&mut h[265..297], f.uname.as_bytes());
    copy_trunc(&mut h[297..329], f.gname.as_bytes());
    // Checksum: computed with the field itself as eight spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    h
}

fn copy_trunc(dst: &mut [u8], src: &[u8]) {
    let n = src.len().min(dst.len());
    dst[..n].copy_from_slice(&src[..n]);
}

/// An octal numeric field (NUL-terminated), or GNU base-256 when the value does not fit.
fn numeric(dst: &mut [u8], v: u64) {
    let digits = dst.len() - 1;
    let s = format!("{v:0digits$o}");
    if s.len() <= digits {
        dst[..digits].copy_from_slice(s.as_bytes());
        dst[digits] = 0;
    } else {
        dst.fill(0);
        let be = v.to_be_bytes();
        let n = dst.len();
        dst[n - 8..].copy_from_slice(&be);
        dst[0] |= 0x80;
    }
}

/// Compresses an uncompressed tar into a layer blob with the matching OCI media type.
/// gzip: default level, no mtime, no file name; zstd: level 3, single-threaded.
pub fn compress(tar: &[u8], c: Compression) -> Blob {
    match c {
        Compression::None => Blob::new(MT_OCI_LAYER, tar.to_vec()),
        Compression::Gzip => {
            let mut enc = flate2::GzBuilder::new()
                .mtime(0)
                .operating_system(255)
                .write(Vec::new(), flate2::Compression::default());
            let data = enc
                .write_all(tar)
                .and_then(|()| enc.finish())
                .unwrap_or_else(|e| panic!("gzip of an in-memory tar failed: {e}"));
            Blob::new(MT_OCI_LAYER_GZIP, data)
        }
        Compression::Zstd => {
            let data = zstd::stream::encode_all(tar, 3)
                .unwrap_or_else(|e| panic!("zstd of an in-memory tar failed: {e}"));
            Blob::new(MT_OCI_LAYER_ZSTD, data)
        }
    }
}

/// Undoes [`compress`] (by media type; anything not gzip/zstd is taken as plain tar).
pub fn decompress(blob: &Blob) -> Vec<u8> {
    let mt = blob.media_type.as_str();
    let mut out = Vec::new();
    let res = if mt.ends_with("gzip") {
        flate2::read::GzDecoder::new(&blob.data[..])
            .read_to_end(&mut out)
            .map(|_| ())
    } else if mt.ends_with("zstd") {
        zstd::stream::decode_all(&blob.data[..]).map(|d| out = d)
    } else {
        out.extend_from_slice(&blob.data);
        Ok(())
    };
    if let Err(e) = res {
        panic!(
            "test layer {} ({mt}) does not decompress: {e}",
            blob.digest()
        );
    }
    out
}

/// An OCI image from uncompressed layer tars: manifest, config (`rootfs.diff_ids` = sha256
/// of each tar, `created` fixed) and the layers compressed as asked.
pub fn image(
    layers: Vec<(Vec<u8>, Compression)>,
    run: RunConfig,
    platform: Platform,
) -> BuiltImage {
    let diff_ids = layers.iter().map(|(tar, _)| Digest::of(tar)).collect();
    let blobs = layers.iter().map(|(tar, c)| compress(tar, *c)).collect();
    image_from_blobs(blobs, diff_ids, run, platform)
}

/// Like [`image`], from layers already compressed (`diff_ids` given alongside).
pub fn image_from_blobs(
    layers: Vec<Blob>,
    diff_ids: Vec<Digest>,
    run: RunConfig,
    platform: Platform,
) -> BuiltImage {
    let history = (0..layers.len())
        .map(|i| {
            serde_json::json!({
                "created": CREATED,
                "created_by": format!("vessel testimages layer {i}"),
            })
        })
        .collect();
    let config = ImageConfig {
        created: Some(CREATED.to_string()),
        architecture: platform.architecture.clone(),
        os: platform.os.clone(),
        variant: platform.variant.clone(),
        config: Some(run),
        rootfs: RootFs {
            kind: "layers".to_string(),
            diff_ids: diff_ids.clone(),
        },
        history,
    };
    let config = Blob::new(MT_OCI_CONFIG, to_json(&config));
    assemble(config, layers, diff_ids)
}

/// A checkpoint image as `buildah` makes one of a CheckpointContainer archive (`buildah from
/// scratch; buildah add $c archive.tar /; buildah config --annotation
/// io.kubernetes.cri-o.annotations.checkpoint.name=<container>`): one layer holding the
/// archive's files, the annotation on the manifest.
pub fn checkpoint_image(archive: &[u8], container: &str) -> BuiltImage {
    let mut img = image(
        vec![(archive.to_vec(), Compression::Gzip)],
        RunConfig::default(),
        linux("amd64", None),
    );
    let mut manifest: Manifest = serde_json::from_slice(&img.manifest.data)
        .unwrap_or_else(|e| panic!("reading a test manifest: {e}"));
    manifest.annotations.insert(
        crate::store::CHECKPOINT_ANNOTATION.to_string(),
        container.to_string(),
    );
    img.manifest = Blob::new(MT_OCI_MANIFEST, to_json(&manifest));
    img
}

/// Wraps a config and layer blobs into an OCI manifest.
fn assemble(config: Blob, layers: Vec<Blob>, diff_ids: Vec<Digest>) -> BuiltImage {
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(MT_OCI_MANIFEST.to_string()),
        config: config.descriptor(),
        layers: layers.iter().map(Blob::descriptor).collect(),
        annotations: BTreeMap::new(),
    };
    BuiltImage {
        manifest: Blob::new(MT_OCI_MANIFEST, to_json(&manifest)),
        config,
        layers,
        diff_ids,
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_else(|e| panic!("serialising a test document: {e}"))
}

struct BusyboxFiles {
    binary: Vec<u8>,
    /// `--list-full` output minus `bin/busybox`, sorted.
    applets: Vec<String>,
}

fn busybox_files() -> &'static BusyboxFiles {
    static FILES: OnceLock<BusyboxFiles> = OnceLock::new();
    FILES.get_or_init(|| {
        let binary = std::fs::read(BUSYBOX_PATH).unwrap_or_else(|e| {
            panic!("test images need {BUSYBOX_PATH} (apt-get install busybox-static): {e}")
        });
        let out = std::process::Command::new(BUSYBOX_PATH)
            .arg("--list-full")
            .output()
            .unwrap_or_else(|e| panic!("running {BUSYBOX_PATH} --list-full: {e}"));
        assert!(
            out.status.success(),
            "{BUSYBOX_PATH} --list-full failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let list = String::from_utf8(out.stdout)
            .unwrap_or_else(|e| panic!("{BUSYBOX_PATH} --list-full printed non-UTF-8: {e}"));
        let mut applets: Vec<String> = list
            .lines()
            .map(|l| l.trim().trim_start_matches('/').to_string())
            .filter(|l| !l.is_empty() && l != "bin/busybox")
            .collect();
        applets.sort();
        applets.dedup();
        for a in &applets {
            assert!(
                !a.split('/').any(|c| c == ".." || c == "." || c.is_empty()),
                "unexpected applet path {a:?} from {BUSYBOX_PATH} --list-full"
            );
        }
        BusyboxFiles { binary, applets }
    })
}

/// The applets of `/bin/busybox` (`--list-full`, without `bin/busybox`), sorted.
pub fn busybox_applets() -> &'static [String] {
    &busybox_files().applets
}

/// A minimal root filesystem: `/bin/busybox` plus every applet as a hard link to it,
/// `/etc/passwd` (root 0, daemon 1, nobody 65534, vessel 1000), `/etc/group` ([`GROUP`]),
/// `/tmp` (1777), `/root` (0700), `/home/vessel` (1000:1000), `/proc /sys /dev /etc /var`.
/// Add entries and `finish()` to make a layer.
pub fn busybox_rootfs() -> LayerBuilder {
    let files = busybox_files();
    let mut b = LayerBuilder::new();
    b.dir("bin", 0o755)
        .dir("dev", 0o755)
        .dir("etc", 0o755)
        .dir("home", 0o755)
        .dir_owned("home/vessel", 0o755, 1000, 1000)
        .dir("proc", 0o555)
        .dir("root", 0o700)
        .dir("sbin", 0o755)
        .dir("sys", 0o555)
        .dir("tmp", 0o1777)
        .dir("usr", 0o755)
        .dir("usr/bin", 0o755)
        .dir("usr/sbin", 0o755)
        .dir("var", 0o755)
        .file("bin/busybox", 0o755, &files.binary);
    for applet in &files.applets {
        b.hardlink(applet, "bin/busybox");
    }
    b.file("etc/passwd", 0o644, PASSWD.as_bytes())
        .file("etc/group", 0o644, GROUP.as_bytes());
    b
}

fn busybox_run_config() -> RunConfig {
    RunConfig {
        env: Some(vec![BUSYBOX_PATH_ENV.to_string()]),
        cmd: Some(vec!["sh".to_string()]),
        ..RunConfig::default()
    }
}

/// A Linux platform of `arch` (and `variant`).
pub fn linux(arch: &str, variant: Option<&str>) -> Platform {
    Platform {
        architecture: arch.to_string(),
        os: "linux".to_string(),
        variant: variant.map(str::to_string),
        os_version: None,
    }
}

fn busybox_tar() -> &'static [u8] {
    static TAR: OnceLock<Vec<u8>> = OnceLock::new();
    TAR.get_or_init(|| busybox_rootfs().finish())
}

/// busybox as a one-layer linux/amd64 image: `Cmd ["sh"]`, `PATH` set.
pub fn busybox_image(c: Compression) -> BuiltImage {
    static CACHE: OnceLock<[OnceLock<BuiltImage>; 3]> = OnceLock::new();
    let slot = match c {
        Compression::None => 0,
        Compression::Gzip => 1,
        Compression::Zstd => 2,
    };
    CACHE.get_or_init(Default::default)[slot]
        .get_or_init(|| {
            image(
                vec![(busybox_tar().to_vec(), c)],
                busybox_run_config(),
                linux("amd64", None),
            )
        })
        .clone()
}

/// busybox (gzip) with `User` set to `user`: `"1000"`, `"1000:1000"`, `"vessel"`, `"nobody"`.
pub fn user_image(user: &str) -> BuiltImage {
    let run = RunConfig {
        user: Some(user.to_string()),
        ..busybox_run_config()
    };
    let base = busybox_image(Compression::Gzip);
    image_from_blobs(base.layers, base.diff_ids, run, linux("amd64", None))
}

/// Two gzip layers. Layer 1: busybox + `/data/keep`, `/data/gone`, `/opaque/old`.
/// Layer 2: whiteout of `/data/gone`; `/opaque` made opaque, with `/opaque/new`.
/// The result must have `/data/keep`, `/opaque/new` and neither `/data/gone` nor `/opaque/old`.
pub fn whiteout_image() -> BuiltImage {
    let mut l1 = busybox_rootfs();
    l1.dir("data", 0o755)
        .file("data/keep", 0o644, b"keep\n")
        .file("data/gone", 0o644, b"gone\n")
        .dir("opaque", 0o755)
        .file("opaque/old", 0o644, b"old\n");
    let mut l2 = LayerBuilder::new();
    l2.dir("data", 0o755)
        .whiteout("data/gone")
        .dir("opaque", 0o755)
        .opaque("opaque")
        .file("opaque/new", 0o644, b"new\n");
    image(
        vec![
            (l1.finish(), Compression::Gzip),
            (l2.finish(), Compression::Gzip),
        ],
        busybox_run_config(),
        linux("amd64", None),
    )
}

/// busybox, an empty layer, a layer with `/hello` (`hello\n`), and the empty layer again:
/// legacy Docker builders repeat their empty layer (each metadata step makes one), so one
/// diff ID appears twice in `rootfs.diff_ids`.
pub fn repeated_layer_image() -> BuiltImage {
    let empty = LayerBuilder::new().finish();
    let mut hello = LayerBuilder::new();
    hello.file("hello", 0o644, b"hello\n");
    image(
        vec![
            (busybox_rootfs().finish(), Compression::Gzip),
            (empty.clone(), Compression::Gzip),
            (hello.finish(), Compression::Gzip),
            (empty, Compression::Gzip),
        ],
        busybox_run_config(),
        linux("amd64", None),
    )
}

/// busybox declaring volumes (Dockerfile `VOLUME`): `/data` (0750, owned 1000:1000, holding
/// `seed` = `seeded\n`), `/cache/deep` (not in the image), `/covered`, and two where the
/// runtime mounts the pod's own: `/dev/shm`, `/etc/resolv.conf`.
pub fn volume_image() -> BuiltImage {
    let mut l = busybox_rootfs();
    l.dir_owned("data", 0o750, 1000, 1000)
        .file_owned("data/seed", 0o640, 1000, 1000, b"seeded\n");
    let volumes = [
        "/data",
        "/cache/deep",
        "/covered",
        "/dev/shm",
        "/etc/resolv.conf",
    ]
    .into_iter()
    .map(|v| (v.to_string(), serde_json::json!({})))
    .collect();
    let run = RunConfig {
        volumes: Some(volumes),
        ..busybox_run_config()
    };
    image(
        vec![(l.finish(), Compression::Gzip)],
        run,
        linux("amd64", None),
    )
}

/// An OCI index over three manifests, in this order:
/// 0. linux/amd64: [`busybox_image`] (gzip);
/// 1. linux/arm64/v8: one layer with only `/ARCH` = `arm64` (config architecture arm64);
/// 2. `unknown/unknown`: a BuildKit-style attestation manifest (annotation
///    `vnd.docker.reference.type: attestation-manifest` pointing at the amd64 manifest),
///    whose single "layer" is an in-toto JSON statement, not a tar.
pub fn multiarch_index() -> Artifact {
    let amd64 = busybox_image(Compression::Gzip);
    let mut arm = LayerBuilder::new();
    arm.file("ARCH", 0o644, ARM64_MARKER);
    let arm64 = image(
        vec![(arm.finish(), Compression::Gzip)],
        RunConfig {
            cmd: Some(vec!["/bin/sh".to_string()]),
            ..RunConfig::default()
        },
        linux("arm64", Some("v8")),
    );

    let statement = serde_json::json!({
        "_type": "https://in-toto.io/Statement/v0.1",
        "predicateType": "https://spdx.dev/Document",
        "subject": [{
            "name": "vessel-test/busybox",
            "digest": {"sha256": amd64.manifest_digest().hex()},
        }],
        "predicate": {"spdxVersion": "SPDX-2.3", "name": "vessel test sbom"},
    });
    let statement = Blob::new(MT_IN_TOTO, to_json(&statement));
    let att_config = serde_json::json!({
        "architecture": "unknown",
        "os": "unknown",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [statement.digest()]},
    });
    let att_config = Blob::new(MT_OCI_CONFIG, to_json(&att_config));
    let att_diff = vec![statement.digest()];
    let mut att = assemble(att_config, vec![statement], att_diff);
    {
        // The statement layer carries its predicate type, as BuildKit writes it.
        let mut m: Manifest = serde_json::from_slice(&att.manifest.data)
            .unwrap_or_else(|e| panic!("re-reading the attestation manifest: {e}"));
        m.layers[0].annotations.insert(
            "in-toto.io/predicate-type".to_string(),
            "https://spdx.dev/Document".to_string(),
        );
        att.manifest = Blob::new(MT_OCI_MANIFEST, to_json(&m));
    }

    let mut entries = Vec::new();
    for img in [&amd64, &arm64] {
        let mut d = img.manifest.descriptor();
        d.platform = Some(img.platform());
        entries.push(d);
    }
    let mut d = att.manifest.descriptor();
    d.platform = Some(Platform {
        architecture: "unknown".to_string(),
        os: "unknown".to_string(),
        variant: None,
        os_version: None,
    });
    d.annotations.insert(
        "vnd.docker.reference.digest".to_string(),
        amd64.manifest_digest().to_string(),
    );
    d.annotations.insert(
        "vnd.docker.reference.type".to_string(),
        "attestation-manifest".to_string(),
    );
    entries.push(d);

    let index = Index {
        schema_version: 2,
        media_type: Some(MT_OCI_INDEX.to_string()),
        manifests: entries,
        annotations: BTreeMap::new(),
    };
    Artifact::Index {
        index: Blob::new(MT_OCI_INDEX, to_json(&index)),
        images: vec![amd64, arm64, att],
    }
}

/// An index of `images` whose entries name no platform (the field is optional; tools that
/// write a single-image index often leave it out).
pub fn platformless_index(images: Vec<BuiltImage>) -> Artifact {
    let index = Index {
        schema_version: 2,
        media_type: Some(MT_OCI_INDEX.to_string()),
        manifests: images.iter().map(|i| i.manifest.descriptor()).collect(),
        annotations: BTreeMap::new(),
    };
    Artifact::Index {
        index: Blob::new(MT_OCI_INDEX, to_json(&index)),
        images,
    }
}

/// busybox's layer as a linux/arm64 image.
pub fn arm64_image() -> BuiltImage {
    let mut arm = LayerBuilder::new();
    arm.file("ARCH", 0o644, ARM64_MARKER);
    image(
        vec![(arm.finish(), Compression::Gzip)],
        busybox_run_config(),
        linux("arm64", Some("v8")),
    )
}

/// A one-layer (gzip) linux/amd64 image whose layer tries to write outside the rootfs;
/// see [`EscapeKind`]. The escaping files contain [`ESCAPE_MARKER`].
pub fn escape_image(kind: EscapeKind) -> BuiltImage {
    let mut b = LayerBuilder::new();
    match kind {
        EscapeKind::DotDot => {
            b.raw_entry(b"../../escaped", b'0', 0o644, 0, 0, b"", ESCAPE_MARKER);
        }
        EscapeKind::SymlinkParent => {
            b.symlink("evil", "../../../../tmp").raw_entry(
                b"evil/escaped",
                b'0',
                0o644,
                0,
                0,
                b"",
                ESCAPE_MARKER,
            );
        }
        EscapeKind::AbsoluteSymlinkParent => {
            b.symlink("abs", "/tmp").raw_entry(
                b"abs/escaped",
                b'0',
                0o644,
                0,
                0,
                b"",
                ESCAPE_MARKER,
            );
        }
    }
    image(
        vec![(b.finish(), Compression::Gzip)],
        busybox_run_config(),
        linux("amd64", None),
    )
}

/// An OCI image-layout tarball: `oci-layout`, `index.json` with one entry for the artifact's
/// top manifest/index annotated `org.opencontainers.image.ref.name: <ref_name>`, and every
/// blob under `blobs/sha256/<hex>`.
pub fn oci_layout_tar(artifact: &Artifact, ref_name: &str) -> Vec<u8> {
    let mut top = artifact.top().descriptor();
    top.annotations.insert(
        "org.opencontainers.image.ref.name".to_string(),
        ref_name.to_string(),
    );
    let index = Index {
        schema_version: 2,
        media_type: Some(MT_OCI_INDEX.to_string()),
        manifests: vec![top],
        annotations: BTreeMap::new(),
    };
    let mut b = LayerBuilder::new();
    b.file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#)
        .file("index.json", 0o644, &to_json(&index))
        .dir("blobs", 0o755)
        .dir("blobs/sha256", 0o755);
    for blob in artifact.all_blobs() {
        b.file(
            &format!("blobs/sha256/{}", blob.digest().hex()),
            0o644,
            &blob.data,
        );
    }
    b.finish()
}

/// A `docker save` tarball: `manifest.json` (`[{Config, RepoTags, Layers}]`), the config as
/// `<hex>.json` and each layer, uncompressed, as `<diff_id hex>/layer.tar`.
pub fn docker_archive_tar(img: &BuiltImage, repo_tags: &[&str]) -> Vec<u8> {
    let config_name = format!("{}.json", img.id().hex());
    let mut b = LayerBuilder::new();
    b.file(&config_name, 0o644, &img.config.data);
    let mut layer_names = Vec::new();
    let mut written = BTreeSet::new();
    for (i, diff_id) in img.diff_ids.iter().enumerate() {
        let name = format!("{}/layer.tar", diff_id.hex());
        if written.insert(name.clone()) {
            let tar = img.layer_tar(i);
            assert_eq!(
                &Digest::of(&tar),
                diff_id,
                "test image layer {i} does not match its diff_id"
            );
            b.dir(diff_id.hex(), 0o755).file(&name, 0o644, &tar);
        }
        layer_names.push(name);
    }
    let manifest = serde_json::json!([{
        "Config": config_name,
        "RepoTags": repo_tags,
        "Layers": layer_names,
    }]);
    b.file("manifest.json", 0o644, &to_json(&manifest));
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(tar: &[u8]) -> Vec<(String, tar::EntryType, Option<String>, u32, u64, u64)> {
        let mut a = tar::Archive::new(tar);
        a.entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    String::from_utf8(e.path_bytes().to_vec()).unwrap(),
                    h.entry_type(),
                    e.link_name_bytes()
                        .map(|l| String::from_utf8(l.to_vec()).unwrap()),
                    h.mode().unwrap(),
                    h.uid().unwrap(),
                    h.gid().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn deterministic() {
        let a = image(
            vec![(busybox_rootfs().finish(), Compression::Gzip)],
            busybox_run_config(),
            linux("amd64", None),
        );
        let b = image(
            vec![(busybox_rootfs().finish(), Compression::Gzip)],
            busybox_run_config(),
            linux("amd64", None),
        );
        assert_eq!(a, b);
        assert_eq!(a, busybox_image(Compression::Gzip));
        let z1 = image(
            vec![(busybox_rootfs().finish(), Compression::Zstd)],
            busybox_run_config(),
            linux("amd64", None),
        );
        assert_eq!(
            z1.manifest_digest(),
            busybox_image(Compression::Zstd).manifest_digest()
        );
        assert_eq!(whiteout_image(), whiteout_image());
        assert_eq!(multiarch_index(), multiarch_index());
        assert_eq!(user_image("1000"), user_image("1000"));
        assert_ne!(user_image("1000").id(), user_image("nobody").id());
        let run = RunConfig {
            user: Some("1000".to_string()),
            ..busybox_run_config()
        };
        let fresh = image(
            vec![(busybox_rootfs().finish(), Compression::Gzip)],
            run,
            linux("amd64", None),
        );
        assert_eq!(fresh, user_image("1000"));
        let ix = multiarch_index();
        assert_eq!(oci_layout_tar(&ix, "latest"), oci_layout_tar(&ix, "latest"));
        let img = busybox_image(Compression::Zstd);
        assert_eq!(
            docker_archive_tar(&img, &["busybox:latest"]),
            docker_archive_tar(&img, &["busybox:latest"])
        );
        // gzip header: no mtime, no name flag.
        let gz = &busybox_image(Compression::Gzip).layers[0].data;
        assert_eq!(&gz[..4], &[0x1f, 0x8b, 8, 0]);
        assert_eq!(&gz[4..8], &[0, 0, 0, 0]);
    }

    #[test]
    fn busybox_layer_hard_links() {
        let tar = busybox_rootfs().finish();
        let es = entries(&tar);
        let links: Vec<_> = es.iter().filter(|e| e.1 == tar::EntryType::Link).collect();
        // Debian 12's busybox has 269 applets; every one but bin/busybox is a hard link.
        assert_eq!(links.len(), busybox_applets().len());
        assert!(links.len() > 250, "only {} applets", links.len());
        assert!(links.iter().all(|e| e.2.as_deref() == Some("bin/busybox")));
        for want in ["bin/sh", "bin/ls", "bin/cat", "usr/bin/id", "bin/sleep"] {
            assert!(links.iter().any(|e| e.0 == want), "{want} missing");
        }
        let bb = es.iter().find(|e| e.0 == "bin/busybox").unwrap();
        assert_eq!((bb.1, bb.3), (tar::EntryType::Regular, 0o755));
        let tmp = es.iter().find(|e| e.0 == "tmp/").unwrap();
        assert_eq!(tmp.3, 0o1777);
        let root = es.iter().find(|e| e.0 == "root/").unwrap();
        assert_eq!(root.3, 0o700);
        let home = es.iter().find(|e| e.0 == "home/vessel/").unwrap();
        assert_eq!((home.4, home.5), (1000, 1000));
        // Parents come before children.
        let pos = |p: &str| es.iter().position(|e| e.0 == p).unwrap();
        assert!(pos("usr/sbin/") < pos("usr/sbin/chroot"));
        assert!(pos("bin/busybox") < pos("bin/sh"));

        // Contents via the tar crate.
        let mut a = tar::Archive::new(&tar[..]);
        let mut passwd = String::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            if e.path_bytes().as_ref() == b"etc/passwd" {
                assert_eq!(e.header().mtime().unwrap(), 0);
                assert_eq!(e.header().username().unwrap(), Some("root"));
                e.read_to_string(&mut passwd).unwrap();
            }
        }
        assert!(passwd.contains("vessel:x:1000:1000:"));
        assert!(passwd.starts_with("root:x:0:0:"));
        assert!(passwd.contains("nobody:x:65534:65534:"));
    }

    #[test]
    fn compression_round_trip() {
        let tar = busybox_rootfs().finish();
        for c in [Compression::None, Compression::Gzip, Compression::Zstd] {
            let blob = compress(&tar, c);
            assert_eq!(decompress(&blob), tar, "{c:?}");
            let mt = match c {
                Compression::None => MT_OCI_LAYER,
                Compression::Gzip => MT_OCI_LAYER_GZIP,
                Compression::Zstd => MT_OCI_LAYER_ZSTD,
            };
            assert_eq!(blob.media_type, mt);
            if c != Compression::None {
                assert!(blob.data.len() < tar.len());
            }
        }
        let mut gz = Vec::new();
        flate2::read::GzDecoder::new(&compress(&tar, Compression::Gzip).data[..])
            .read_to_end(&mut gz)
            .unwrap();
        assert_eq!(gz, tar);
    }

    #[test]
    fn diff_ids_and_manifest_are_consistent() {
        let img = whiteout_image();
        let cfg = img.image_config();
        assert_eq!(cfg.rootfs.diff_ids, img.diff_ids);
        assert_eq!(cfg.created.as_deref(), Some(CREATED));
        assert_eq!(
            cfg.config.as_ref().unwrap().cmd,
            Some(vec!["sh".to_string()])
        );
        for (i, d) in img.diff_ids.iter().enumerate() {
            assert_eq!(&Digest::of(&img.layer_tar(i)), d);
        }
        let m: Manifest = serde_json::from_slice(&img.manifest.data).unwrap();
        assert_eq!(m.config, img.config.descriptor());
        assert_eq!(m.config.digest, img.id());
        assert_eq!(m.layers.len(), 2);
        for (d, b) in m.layers.iter().zip(&img.layers) {
            assert_eq!(d, &b.descriptor());
        }
        let l2 = entries(&img.layer_tar(1));
        let names: Vec<&str> = l2.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "data/",
                "data/.wh.gone",
                "opaque/",
                "opaque/.wh..wh..opq",
                "opaque/new"
            ]
        );
        let u = user_image("vessel");
        assert_eq!(
            u.image_config().config.unwrap().user.as_deref(),
            Some("vessel")
        );
        assert_eq!(u.layers, busybox_image(Compression::Gzip).layers);
    }

    #[test]
    fn escape_layers_contain_malicious_names() {
        let e = entries(&escape_image(EscapeKind::DotDot).layer_tar(0));
        assert_eq!(e[0].0, "../../escaped");
        let e = entries(&escape_image(EscapeKind::SymlinkParent).layer_tar(0));
        assert_eq!(e[0].0, "evil");
        assert_eq!(e[0].1, tar::EntryType::Symlink);
        assert_eq!(e[0].2.as_deref(), Some("../../../../tmp"));
        assert_eq!(e[1].0, "evil/escaped");
        let e = entries(&escape_image(EscapeKind::AbsoluteSymlinkParent).layer_tar(0));
        assert_eq!(e[0].2.as_deref(), Some("/tmp"));
        assert_eq!(e[1].0, "abs/escaped");
        // The tar crate's own unpacker refuses the `..` entry: the header really holds it.
        let tar = escape_image(EscapeKind::DotDot).layer_tar(0);
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join("a/b");
        std::fs::create_dir_all(&inner).unwrap();
        let _ = tar::Archive::new(&tar[..]).unpack(&inner);
        assert!(!dir.path().join("escaped").exists());
    }

    #[test]
    fn long_names_and_big_numbers() {
        let long = format!("d/{}", "x".repeat(150));
        let target = format!("/{}", "y".repeat(120));
        let mut b = LayerBuilder::new();
        b.file(&long, 0o600, b"hi").symlink("l", &target);
        let es = entries(&b.finish());
        assert_eq!(es[0].0, long);
        assert_eq!(es[0].3, 0o600);
        assert_eq!(es[1].2.as_deref(), Some(target.as_str()));
        let mut field = [0u8; 12];
        numeric(&mut field, 1 << 40);
        assert_eq!(field[0], 0x80);
        numeric(&mut field, 5);
        assert_eq!(&field, b"00000000005\0");
    }

    #[test]
    fn multiarch_and_archives() {
        let ix = multiarch_index();
        let Artifact::Index { index, images } = &ix else {
            panic!("not an index")
        };
        let parsed: Index = serde_json::from_slice(&index.data).unwrap();
        assert_eq!(parsed.manifests.len(), 3);
        let plats: Vec<String> = parsed
            .manifests
            .iter()
            .map(|d| d.platform.as_ref().unwrap().to_string())
            .collect();
        assert_eq!(plats, ["linux/amd64", "linux/arm64/v8", "unknown/unknown"]);
        for (d, img) in parsed.manifests.iter().zip(images) {
            assert_eq!(d.digest, img.manifest_digest());
        }
        assert_eq!(images[1].image_config().architecture, "arm64");
        let arm = entries(&images[1].layer_tar(0));
        assert_eq!(arm[0].0, "ARCH");

        // OCI layout: every blob present under its digest.
        let layout = oci_layout_tar(&ix, "docker.io/library/multi:latest");
        let mut a = tar::Archive::new(&layout[..]);
        let mut files = BTreeMap::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let p = String::from_utf8(e.path_bytes().to_vec()).unwrap();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            files.insert(p, data);
        }
        let idx: Index = serde_json::from_slice(&files["index.json"]).unwrap();
        assert_eq!(idx.manifests[0].digest, ix.top_digest());
        assert_eq!(
            idx.manifests[0].annotations["org.opencontainers.image.ref.name"],
            "docker.io/library/multi:latest"
        );
        for blob in ix.all_blobs() {
            let data = &files[&format!("blobs/sha256/{}", blob.digest().hex())];
            assert_eq!(&Digest::of(data), &blob.digest());
        }

        // docker-archive: uncompressed layers matching the diff_ids.
        let img = busybox_image(Compression::Zstd);
        let arch = docker_archive_tar(&img, &["busybox:latest"]);
        let mut a = tar::Archive::new(&arch[..]);
        let mut files = BTreeMap::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let p = String::from_utf8(e.path_bytes().to_vec()).unwrap();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            files.insert(p, data);
        }
        let m: serde_json::Value = serde_json::from_slice(&files["manifest.json"]).unwrap();
        assert_eq!(m[0]["RepoTags"][0], "busybox:latest");
        let cfg = m[0]["Config"].as_str().unwrap();
        assert_eq!(Digest::of(&files[cfg]), img.id());
        let layer = m[0]["Layers"][0].as_str().unwrap();
        assert_eq!(Digest::of(&files[layer]), img.diff_ids[0]);
    }
}

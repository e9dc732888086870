//! End to end: a real vesseld on a temporary socket, driven over CRI, pulling deterministic
//! busybox images from a real docker-registry on 127.0.0.1.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::Code;
use vessel_cri_api::v1 as cri;
use vessel_critest::daemon::{mounts_under, Vesseld};
use vessel_critest::registry::{Registry, RegistryOptions};
use vessel_images::push::{push_artifact, push_image, PushTarget};
use vessel_images::testimages::{self, Compression, EscapeKind};

fn vesseld(extra: &str) -> Vesseld {
    Vesseld::start(Path::new(env!("CARGO_BIN_EXE_vesseld")), extra).expect("starting vesseld")
}

fn registry(opts: RegistryOptions) -> Registry {
    Registry::start(opts).expect("starting docker-registry")
}

fn target(reg: &Registry, repo: &str) -> PushTarget {
    let mut t = PushTarget::new(&reg.url(), repo);
    t.insecure_tls = true;
    t
}

fn spec(image: &str) -> Option<cri::ImageSpec> {
    Some(cri::ImageSpec {
        image: image.to_string(),
        ..Default::default()
    })
}

async fn pull(
    c: &mut vessel_critest::client::CriClient,
    image: &str,
    auth: Option<cri::AuthConfig>,
) -> Result<String, tonic::Status> {
    c.images
        .pull_image(cri::PullImageRequest {
            image: spec(image),
            auth,
            sandbox_config: None,
        })
        .await
        .map(|r| r.into_inner().image_ref)
}

async fn status(c: &mut vessel_critest::client::CriClient, image: &str) -> Option<cri::Image> {
    c.images
        .image_status(cri::ImageStatusRequest {
            image: spec(image),
            verbose: false,
        })
        .await
        .expect("ImageStatus")
        .into_inner()
        .image
}

async fn list(c: &mut vessel_critest::client::CriClient) -> Vec<cri::Image> {
    list_filtered(c, None).await
}

/// ListImages, with a filter of `image` where one is given.
async fn list_filtered(
    c: &mut vessel_critest::client::CriClient,
    image: Option<&str>,
) -> Vec<cri::Image> {
    let filter = image.map(|i| cri::ImageFilter { image: spec(i) });
    c.images
        .list_images(cri::ListImagesRequest { filter })
        .await
        .expect("ListImages")
        .into_inner()
        .images
}

async fn remove(c: &mut vessel_critest::client::CriClient, image: &str) {
    c.images
        .remove_image(cri::RemoveImageRequest { image: spec(image) })
        .await
        .unwrap_or_else(|e| panic!("RemoveImage {image}: {e}"));
}

async fn fs_used(c: &mut vessel_critest::client::CriClient) -> (u64, u64) {
    let r = c
        .images
        .image_fs_info(cri::ImageFsInfoRequest {})
        .await
        .expect("ImageFsInfo")
        .into_inner();
    let fs = &r.image_filesystems[0];
    (
        fs.used_bytes.as_ref().unwrap().value,
        fs.inodes_used.as_ref().unwrap().value,
    )
}

fn dir_entries(p: &Path) -> Vec<String> {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The store holds no blob, layer, record, snapshot or temp file.
fn assert_store_empty(v: &Vesseld) {
    let root = v.root_dir().join("images");
    for d in ["blobs/sha256", "layers", "records", "snapshots", "tmp"] {
        let e = dir_entries(&root.join(d));
        assert!(e.is_empty(), "{d} should be empty, has {e:?}");
    }
}

/// SIGHUP applies registry settings from the configuration (here a drop-in that sends pulls
/// to a dead mirror, then its removal) without a restart, and names the keys that wait for
/// one; a configuration that does not load changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_registry_settings() {
    let reg = registry(RegistryOptions::default());
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&target(&reg, "hup"), &img, Some("v1"))
        .await
        .unwrap();
    let v = vesseld("");
    let mut c = v.client().await;
    let name = format!("{}/hup:v1", reg.host());
    let dropins = v.dir.path().join("config.d");
    std::fs::create_dir(&dropins).unwrap();
    let hup = |n: usize| {
        // SAFETY: kill(2) on the vesseld child this test started.
        unsafe {
            libc::kill(v.pid().unwrap() as libc::pid_t, libc::SIGHUP);
        }
        let start = std::time::Instant::now();
        while v.log().matches("SIGHUP: configuration reloaded").count() < n {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(20),
                "{}",
                v.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    std::fs::write(
        dropins.join("50-mirror.toml"),
        format!(
            "[images.registries.\"{}\"]\nmirrors = [\"http://127.0.0.1:9\"]\nmirrors_only = true\n",
            reg.host()
        ),
    )
    .unwrap();
    hup(1);
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert!(e.message().contains("127.0.0.1:9"), "{e:?}");

    // A drop-in with a typo: nothing changes (the mirror stays), and the log says why.
    std::fs::write(dropins.join("70-typo.toml"), "[images]\nplatfrom = \"x\"\n").unwrap();
    // SAFETY: as above.
    unsafe {
        libc::kill(v.pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
    let start = std::time::Instant::now();
    while !v.log().contains("configuration not reloaded") {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "{}",
            v.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(pull(&mut c, &name, None).await.is_err());

    std::fs::remove_file(dropins.join("70-typo.toml")).unwrap();
    std::fs::remove_file(dropins.join("50-mirror.toml")).unwrap();
    std::fs::write(
        dropins.join("60-restart.toml"),
        "[images]\nmax_concurrent_downloads = 7\n",
    )
    .unwrap();
    hup(2);
    pull(&mut c, &name, None)
        .await
        .expect("the pull goes to the registry again");
    let log = v.log();
    assert!(
        log.contains("take effect at the next restart")
            && log.contains("images.max_concurrent_downloads"),
        "{log}"
    );
}

/// Under systemd (`Type=notify`), vesseld says READY=1 once its CRI socket serves, and
/// STOPPING=1 when it shuts down; its pod agents do not inherit the notify socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tells_the_service_manager_when_it_serves() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("notify");
    let rx = std::os::unix::net::UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    // This test runs in a process of its own (nextest): vesseld inherits the variable.
    std::env::set_var("NOTIFY_SOCKET", &sock);
    let mut v = vesseld("");
    std::env::remove_var("NOTIFY_SOCKET");
    let mut buf = [0u8; 512];
    let n = rx.recv(&mut buf).expect("a notify message from vesseld");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.starts_with("READY=1\n"), "{msg}");
    assert!(msg.contains("STATUS=serving CRI on"), "{msg}");
    // READY came after the socket serves: a call answers at once.
    let mut c = v.client().await;
    c.runtime
        .version(cri::VersionRequest::default())
        .await
        .expect("Version after READY");
    drop(c);
    let status = v.stop();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let n = rx.recv(&mut buf).expect("STOPPING from vesseld");
    assert_eq!(&buf[..n], b"STOPPING=1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_status_and_an_empty_checkpoint_request() {
    let v = vesseld("");
    let mut c = v.client().await;
    let ver = c
        .runtime
        .version(cri::VersionRequest {
            version: "0.1.0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ver.runtime_name, "vessel");
    assert_eq!(ver.runtime_api_version, "v1");
    assert_eq!(ver.version, "0.1.0");
    assert!(!ver.runtime_version.is_empty());

    let st = c.status(true).await.unwrap();
    let conds = st.status.unwrap().conditions;
    let types: Vec<_> = conds.iter().map(|c| c.r#type.as_str()).collect();
    assert!(types.contains(&"RuntimeReady") && types.contains(&"NetworkReady"));
    // Every condition that is false says why.
    assert!(conds
        .iter()
        .all(|c| c.status || (!c.reason.is_empty() && !c.message.is_empty())));
    let runtime_ready = conds.iter().find(|c| c.r#type == "RuntimeReady").unwrap();
    assert!(runtime_ready.status, "{runtime_ready:?}");
    assert!(st.info.contains_key("config"));

    let e = c
        .runtime
        .checkpoint_container(cri::CheckpointContainerRequest::default())
        .await
        .unwrap_err();
    // Served (pods_e2e checkpoints containers); an empty request names what is missing.
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("location"), "{}", e.message());
    assert!(
        e.message().contains("CheckpointContainer"),
        "{}",
        e.message()
    );

    // The socket is 0660.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&v.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_by_tag_digest_and_without_tag() {
    let reg = registry(RegistryOptions::default());
    let img = testimages::busybox_image(Compression::Gzip);
    let t = target(&reg, "library/busybox");
    push_image(&t, &img, Some("latest")).await.unwrap();
    push_image(&t, &img, Some("1.35")).await.unwrap();
    let v = vesseld("");
    let mut c = v.client().await;
    let host = reg.host();

    // Without a tag: latest.
    let id = pull(&mut c, &format!("{host}/library/busybox"), None)
        .await
        .unwrap();
    assert_eq!(id, img.id().to_string());
    let s = status(&mut c, &format!("{host}/library/busybox:latest"))
        .await
        .unwrap();
    assert_eq!(s.id, id);
    assert_eq!(s.repo_tags, vec![format!("{host}/library/busybox:latest")]);
    assert_eq!(
        s.repo_digests,
        vec![format!("{host}/library/busybox@{}", img.manifest_digest())]
    );
    let layer_bytes: u64 = img.layers.iter().map(|l| l.size()).sum();
    assert_eq!(s.size, layer_bytes + img.config.size());

    // By another tag: same image, both tags.
    pull(&mut c, &format!("{host}/library/busybox:1.35"), None)
        .await
        .unwrap();
    // By digest.
    let by_digest = format!("{host}/library/busybox@{}", img.manifest_digest());
    assert_eq!(pull(&mut c, &by_digest, None).await.unwrap(), id);
    let all = list(&mut c).await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0].repo_tags.len(), 2);
    assert!(status(&mut c, &by_digest).await.is_some());
    assert!(status(&mut c, &id).await.is_some());
    assert!(status(&mut c, id.trim_start_matches("sha256:"))
        .await
        .is_some());

    // The layer is unpacked once, busybox applets as hard links of one inode.
    let layer = v
        .root_dir()
        .join("images/layers")
        .join(img.diff_ids[0].hex());
    use std::os::unix::fs::MetadataExt;
    let bb = std::fs::metadata(layer.join("bin/busybox")).unwrap();
    let sh = std::fs::metadata(layer.join("bin/sh")).unwrap();
    assert_eq!(bb.ino(), sh.ino());
    assert!(bb.nlink() > 250, "busybox has {} links", bb.nlink());
    let home = std::fs::metadata(layer.join("home/vessel")).unwrap();
    assert_eq!((home.uid(), home.gid()), (1000, 1000));
    assert_eq!(
        std::fs::metadata(layer.join("tmp")).unwrap().mode() & 0o7777,
        0o1777
    );
    assert_eq!(dir_entries(&v.root_dir().join("images/layers")).len(), 1);

    // ListImages with a filter.
    let filtered = list_filtered(&mut c, Some(&format!("{host}/library/busybox:1.35"))).await;
    assert_eq!(filtered.len(), 1);
    let none = list_filtered(&mut c, Some(&format!("{host}/library/other"))).await;
    assert!(none.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multiarch_index_resolves_to_configured_platform() {
    let reg = registry(RegistryOptions::default());
    let art = testimages::multiarch_index();
    push_artifact(&target(&reg, "multi"), &art, Some("v1"))
        .await
        .unwrap();
    let amd64 = art.images()[0].id();
    let arm64 = art.images()[1].id();
    let name = format!("{}/multi:v1", reg.host());

    let v = vesseld("");
    let mut c = v.client().await;
    assert_eq!(pull(&mut c, &name, None).await.unwrap(), amd64.to_string());
    let s = status(&mut c, &name).await.unwrap();
    // The repo digest is the index's, as containerd records it.
    assert_eq!(
        s.repo_digests,
        vec![format!("{}/multi@{}", reg.host(), art.top_digest())]
    );
    drop(c);
    drop(v);

    let v = vesseld("[images]\nplatform = \"linux/arm64\"\n");
    let mut c = v.client().await;
    assert_eq!(pull(&mut c, &name, None).await.unwrap(), arm64.to_string());
    drop(c);
    drop(v);

    let v = vesseld("[images]\nplatform = \"linux/s390x\"\n");
    let mut c = v.client().await;
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("linux/s390x"), "{}", e.message());
    assert_store_empty(&v);
}

/// An index entry that names no platform is taken where its image's config is the node's
/// platform (as containerd takes it), and not where it is another's: an arm64 image was
/// pulled on amd64 and failed at every start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_entries_without_a_platform_are_taken_by_their_config() {
    let reg = registry(RegistryOptions::default());
    let amd64 = testimages::platformless_index(vec![testimages::busybox_image(Compression::Gzip)]);
    let arm64 = testimages::platformless_index(vec![testimages::arm64_image()]);
    push_artifact(&target(&reg, "anyplat"), &amd64, Some("amd64"))
        .await
        .unwrap();
    push_artifact(&target(&reg, "anyplat"), &arm64, Some("arm64"))
        .await
        .unwrap();
    let v = vesseld("");
    let mut c = v.client().await;
    let name = format!("{}/anyplat:amd64", reg.host());
    assert_eq!(
        pull(&mut c, &name, None).await.unwrap(),
        amd64.images()[0].id().to_string()
    );
    let e = pull(&mut c, &format!("{}/anyplat:arm64", reg.host()), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert!(e.message().contains("linux/arm64"), "{}", e.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_whiteouts_and_user_fields() {
    let reg = registry(RegistryOptions::default());
    let z = testimages::busybox_image(Compression::Zstd);
    let w = testimages::whiteout_image();
    push_image(&target(&reg, "zstd"), &z, Some("v1"))
        .await
        .unwrap();
    push_image(&target(&reg, "whiteout"), &w, Some("v1"))
        .await
        .unwrap();
    let users = [
        ("1000", Some(1000), ""),
        ("1000:1000", Some(1000), ""),
        ("vessel", None, "vessel"),
        ("nobody", None, "nobody"),
    ];
    for (i, (u, _, _)) in users.iter().enumerate() {
        push_image(
            &target(&reg, "user"),
            &testimages::user_image(u),
            Some(&format!("u{i}")),
        )
        .await
        .unwrap();
    }
    let v = vesseld("");
    let mut c = v.client().await;
    let h = reg.host();
    assert_eq!(
        pull(&mut c, &format!("{h}/zstd:v1"), None).await.unwrap(),
        z.id().to_string()
    );
    assert_eq!(
        pull(&mut c, &format!("{h}/whiteout:v1"), None)
            .await
            .unwrap(),
        w.id().to_string()
    );
    for (i, (u, uid, name)) in users.iter().enumerate() {
        let r = format!("{h}/user:u{i}");
        pull(&mut c, &r, None).await.unwrap();
        let s = status(&mut c, &r).await.unwrap();
        assert_eq!(s.uid.map(|x| x.value), *uid, "user {u}");
        assert_eq!(s.username, *name, "user {u}");
    }
    let plain = status(&mut c, &format!("{h}/zstd:v1")).await.unwrap();
    assert!(plain.uid.is_none() && plain.username.is_empty());

    // Whiteouts are overlay whiteouts; a snapshot over the layers shows the merged view.
    let store = vessel_images::ImageStore::open(v.root_dir().join("images")).unwrap();
    let upper_layer = store.layer_path(&w.diff_ids[1]);
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let gone = std::fs::symlink_metadata(upper_layer.join("data/gone")).unwrap();
    assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
    let rec = store.find(&format!("{h}/whiteout:v1")).unwrap().unwrap();
    let snap = store.prepare_snapshot("e2e-whiteout", &rec).unwrap();
    let root = snap.mount_overlay().unwrap();
    assert!(root.join("data/keep").exists());
    assert!(!root.join("data/gone").exists());
    assert!(!root.join("opaque/old").exists());
    assert!(root.join("opaque/new").exists());
    assert!(root.join("bin/busybox").exists());
    // An image in use by a snapshot cannot be removed.
    let e = c
        .images
        .remove_image(cri::RemoveImageRequest {
            image: spec(&rec.id.to_string()),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    store.remove_snapshot("e2e-whiteout").unwrap();
    assert!(mounts_under(v.dir.path()).is_empty());
    remove(&mut c, &rec.id.to_string()).await;
    assert!(status(&mut c, &format!("{h}/whiteout:v1")).await.is_none());
}

/// A registry wanting Basic auth (alice / s3cret), with the busybox image pushed as
/// `private/app:v1`; the image and its name.
async fn private_registry() -> (Registry, testimages::BuiltImage, String) {
    let reg = registry(RegistryOptions {
        htpasswd: Some(("alice".into(), "s3cret".into())),
        ..Default::default()
    });
    let mut t = target(&reg, "private/app");
    t.basic_auth = Some(("alice".into(), "s3cret".into()));
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&t, &img, Some("v1")).await.unwrap();
    let name = format!("{}/private/app:v1", reg.host());
    (reg, img, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_ok_wrong_and_missing() {
    let (reg, img, name) = private_registry().await;

    let v = vesseld("");
    let mut c = v.client().await;
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    let wrong = cri::AuthConfig {
        username: "alice".into(),
        password: "wrong".into(),
        ..Default::default()
    };
    let e = pull(&mut c, &name, Some(wrong)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert!(e.message().contains(&reg.host()), "{}", e.message());
    assert_store_empty(&v);
    // The `auth` field form (base64 user:password) works as well as username/password.
    use base64::Engine as _;
    let ok = cri::AuthConfig {
        auth: base64::engine::general_purpose::STANDARD.encode("alice:s3cret"),
        ..Default::default()
    };
    assert_eq!(
        pull(&mut c, &name, Some(ok)).await.unwrap(),
        img.id().to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_token_auth() {
    let reg = registry(RegistryOptions {
        htpasswd: Some(("bob".into(), "hunter2".into())),
        token_auth: true,
        ..Default::default()
    });
    let mut t = target(&reg, "tok/app");
    t.basic_auth = Some(("bob".into(), "hunter2".into()));
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&t, &img, Some("v1")).await.unwrap();
    let name = format!("{}/tok/app:v1", reg.host());
    let v = vesseld("");
    let mut c = v.client().await;
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    let before = reg.tokens_issued();
    let creds = cri::AuthConfig {
        username: "bob".into(),
        password: "hunter2".into(),
        ..Default::default()
    };
    assert_eq!(
        pull(&mut c, &name, Some(creds.clone())).await.unwrap(),
        img.id().to_string()
    );
    assert!(reg.tokens_issued() > before, "no token was issued");
    // The token bob was given is his: a pull without credentials, or with a wrong password,
    // while it is still valid (an hour) is refused as before (the registry's own answer),
    // and bob's next pull is let in.
    remove(&mut c, &name).await;
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "no credentials: {e}");
    let wrong = cri::AuthConfig {
        password: "hunter3".into(),
        ..creds.clone()
    };
    let e = pull(&mut c, &name, Some(wrong)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "a wrong password: {e}");
    assert_eq!(
        pull(&mut c, &name, Some(creds)).await.unwrap(),
        img.id().to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_registry_verified_with_ca_file() {
    let reg = registry(RegistryOptions {
        tls: true,
        ..Default::default()
    });
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&target(&reg, "tls/app"), &img, Some("v1"))
        .await
        .unwrap();
    let name = format!("{}/tls/app:v1", reg.host());
    let ca = reg.dir().join("vessel-ca.pem");
    std::fs::write(&ca, reg.ca_pem().unwrap()).unwrap();

    // Configured, not insecure, no CA: certificate verification fails.
    let v = vesseld(&format!(
        "[images.registries.\"{}\"]\ninsecure = false\n",
        reg.host()
    ));
    let mut c = v.client().await;
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    drop(c);
    drop(v);

    // With the registry's CA: verified and pulled over HTTPS.
    let v = vesseld(&format!(
        "[images.registries.\"{}\"]\nca_file = \"{}\"\n",
        reg.host(),
        ca.display()
    ));
    let mut c = v.client().await;
    assert_eq!(
        pull(&mut c, &name, None).await.unwrap(),
        img.id().to_string()
    );
}

/// A mirror that answers every request with 500 and keeps each request's head (request line
/// and headers, lower-cased) for the test to read.
async fn failing_mirror() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let heads = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let heads = heads.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 << 10];
                let mut n = 0;
                // One request per connection (Connection: close); read to the blank line.
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                heads
                    .lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase());
                let body = br#"{"errors":[{"code":"UNKNOWN","message":"mirror is broken"}]}"#;
                let hdr = format!(
                    "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(hdr.as_bytes()).await;
                let _ = s.write_all(body).await;
            });
        }
    });
    (port, seen)
}

/// Mirrors as containerd's hosts.toml has them: one answering 500 (with its own header),
/// one lacking the image (404), and a pull-only one that may serve blobs but not resolve a
/// tag. The tag is resolved by the registry itself, every blob comes from the pull-only
/// mirror, and each failing mirror is fallen through. An image nobody has is NotFound (the
/// registry's answer), not the broken mirror's 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirrors_fall_through_by_capability_with_headers() {
    let img = testimages::busybox_image(Compression::Gzip);
    let upstream = registry(RegistryOptions::default());
    push_image(&target(&upstream, "mirrored/app"), &img, Some("v1"))
        .await
        .unwrap();
    let empty = registry(RegistryOptions::default());
    let pull_only = registry(RegistryOptions::default());
    push_image(&target(&pull_only, "mirrored/app"), &img, Some("v1"))
        .await
        .unwrap();
    let (broken, heads) = failing_mirror().await;
    let up = upstream.host();
    let v = vesseld(&format!(
        r#"
[images.registries."{up}"]
plain_http = true
headers = {{ "X-Vessel-Test" = "host" }}
[[images.registries."{up}".mirrors]]
url = "http://127.0.0.1:{broken}"
headers = {{ "X-Vessel-Test" = "broken-mirror" }}
[[images.registries."{up}".mirrors]]
url = "{empty}"
[[images.registries."{up}".mirrors]]
url = "{pull_only}"
capabilities = ["pull"]
"#,
        empty = empty.url(),
        pull_only = pull_only.url(),
    ));
    let mut c = v.client().await;
    let name = format!("{up}/mirrored/app:v1");
    assert_eq!(
        pull(&mut c, &name, None).await.unwrap(),
        img.id().to_string()
    );

    let heads = heads.lock().unwrap().clone();
    let tag_get = format!("get /v2/mirrored/app/manifests/v1?ns={up} ");
    assert!(
        heads
            .iter()
            .any(|h| h.starts_with(&tag_get) && h.contains("\r\nx-vessel-test: broken-mirror\r\n")),
        "the broken mirror was asked for the tag, with its header: {heads:#?}"
    );
    assert!(
        heads.iter().any(|h| h.contains("/blobs/")),
        "blobs were asked of the broken mirror first: {heads:#?}"
    );
    assert!(
        empty
            .log_tail()
            .contains("\"GET /v2/mirrored/app/manifests/v1"),
        "the empty mirror was asked for the tag: {}",
        empty.log_tail()
    );
    assert!(
        !pull_only
            .log_tail()
            .contains("\"GET /v2/mirrored/app/manifests/v1"),
        "a pull-only mirror resolved a tag: {}",
        pull_only.log_tail()
    );
    assert!(
        upstream
            .log_tail()
            .contains("/v2/mirrored/app/manifests/v1"),
        "{}",
        upstream.log_tail()
    );
    for layer in &img.layers {
        let d = layer.digest();
        assert_eq!(
            pull_only.blob_get_count(&d),
            1,
            "layer {d} from the pull-only mirror"
        );
        assert_eq!(
            upstream.blob_get_count(&d),
            0,
            "layer {d} not from the registry"
        );
    }

    let e = pull(&mut c, &format!("{up}/mirrored/none:v1"), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
}

/// A registry that wants a client certificate (mutual TLS): refused without one; pulled with
/// the host section's certificate and key, and with those of the `_default` section for a
/// host without a section. `skip_verify` is HTTPS without verification and `plain_http` is
/// plain HTTP: neither stands in for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_registry_client_certificates_default_section_and_skip_verify() {
    let reg = registry(RegistryOptions {
        tls: true,
        mtls: true,
        ..Default::default()
    });
    let (cert, key) = (
        reg.client_cert_pem().unwrap(),
        reg.client_key_pem().unwrap(),
    );
    let mut t = target(&reg, "mtls/app");
    t.client_identity_pem = Some(format!("{cert}{key}"));
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&t, &img, Some("v1")).await.unwrap();
    let name = format!("{}/mtls/app:v1", reg.host());
    let files = reg.dir().join("node-certs");
    std::fs::create_dir(&files).unwrap();
    let (ca_f, cert_f, key_f) = (
        files.join("ca.pem"),
        files.join("client.pem"),
        files.join("client.key"),
    );
    std::fs::write(&ca_f, reg.ca_pem().unwrap()).unwrap();
    std::fs::write(&cert_f, &cert).unwrap();
    std::fs::write(&key_f, &key).unwrap();
    let client = format!(
        "client_cert = \"{}\"\nclient_key = \"{}\"\n",
        cert_f.display(),
        key_f.display()
    );
    let section = |name: &str, body: &str| format!("[images.registries.\"{name}\"]\n{body}");
    let cases = [
        (
            "CA only",
            section(&reg.host(), &format!("ca_file = \"{}\"\n", ca_f.display())),
            false,
        ),
        (
            "CA and client certificate",
            section(
                &reg.host(),
                &format!("ca_file = \"{}\"\n{client}", ca_f.display()),
            ),
            true,
        ),
        (
            "_default section",
            section(
                "_default",
                &format!("ca_file = \"{}\"\n{client}", ca_f.display()),
            ),
            true,
        ),
        (
            "skip_verify",
            section(&reg.host(), &format!("skip_verify = true\n{client}")),
            true,
        ),
        (
            "plain_http",
            section(&reg.host(), &format!("plain_http = true\n{client}")),
            false,
        ),
    ];
    for (what, config, ok) in cases {
        let v = vesseld(&config);
        let mut c = v.client().await;
        let res = pull(&mut c, &name, None).await;
        match (ok, res) {
            (true, Ok(id)) => assert_eq!(id, img.id().to_string(), "{what}"),
            (false, Err(e)) => {
                assert_eq!(e.code(), Code::Unavailable, "{what}: {e}");
                assert_store_empty(&v);
            }
            (_, res) => panic!("{what}: {res:?}\n{config}"),
        }
    }
}

/// The node's auth file (docker `config.json`) is used when kubelet sends no credentials,
/// or sends them for another registry; it is read at each pull, so writing it needs no
/// restart. Kubelet's credentials for this registry win over the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_auth_file_when_kubelet_sends_no_credentials() {
    use base64::Engine as _;
    let (reg, img, name) = private_registry().await;
    let d = tempfile::tempdir().unwrap();
    let auth_file = d.path().join("config.json");
    let v = vesseld(&format!(
        "[images]\nauth_file = \"{}\"\n",
        auth_file.display()
    ));
    let mut c = v.client().await;

    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "no file yet: {e}");
    std::fs::write(
        &auth_file,
        format!(
            r#"{{"auths": {{"{}": {{"auth": "{}"}}}}}}"#,
            reg.host(),
            base64::engine::general_purpose::STANDARD.encode("alice:s3cret")
        ),
    )
    .unwrap();
    assert_eq!(
        pull(&mut c, &name, None).await.unwrap(),
        img.id().to_string()
    );
    remove(&mut c, &name).await;

    let wrong = |server: &str| cri::AuthConfig {
        username: "alice".into(),
        password: "wrong".into(),
        server_address: server.into(),
        ..Default::default()
    };
    let e = pull(&mut c, &name, Some(wrong(""))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "kubelet's win: {e}");
    let e = pull(&mut c, &name, Some(wrong(&reg.host())))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "kubelet's win: {e}");
    assert_eq!(
        pull(&mut c, &name, Some(wrong("other.example:5000")))
            .await
            .unwrap(),
        img.id().to_string(),
        "credentials for another registry do not apply; the file's do"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_invalid_images() {
    let reg = registry(RegistryOptions::default());
    let v = vesseld("");
    let mut c = v.client().await;
    let name = format!("{}/does/not-exist:v9", reg.host());
    let e = pull(&mut c, &name, None).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert!(e.message().contains("does/not-exist"), "{}", e.message());
    assert!(
        e.message().contains("MANIFEST_UNKNOWN") || e.message().contains("NAME_UNKNOWN"),
        "{}",
        e.message()
    );
    // Not present: nil image, no error (kubelet asks before every pull).
    assert!(status(&mut c, &name).await.is_none());
    let e = pull(&mut c, "Not A Reference!", None).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let e = pull(&mut c, "", None).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // Unreachable registry: Unavailable, naming it.
    let e = pull(&mut c, "127.0.0.1:1/x:y", None).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("127.0.0.1:1"), "{}", e.message());
    // Removing what is not there is fine.
    remove(&mut c, &name).await;
    remove(&mut c, &format!("sha256:{}", "0".repeat(64))).await;
    assert_store_empty(&v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_blob_is_rejected_and_nothing_stored() {
    let reg = registry(RegistryOptions::default());
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&target(&reg, "corrupt"), &img, Some("v1"))
        .await
        .unwrap();
    // Serve different bytes of the same length under the layer's digest.
    let layer = img.layers[0].digest();
    let p = reg.blob_path(&layer);
    let mut data = std::fs::read(&p).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0xff;
    std::fs::write(&p, &data).unwrap();

    let v = vesseld("");
    let mut c = v.client().await;
    let e = pull(&mut c, &format!("{}/corrupt:v1", reg.host()), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("digest mismatch"), "{}", e.message());
    assert!(e.message().contains(layer.as_str()), "{}", e.message());
    assert!(list(&mut c).await.is_empty());
    assert_store_empty(&v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_escapes_are_rejected_and_nothing_left() {
    let reg = registry(RegistryOptions::default());
    let v = vesseld("");
    let mut c = v.client().await;
    for (i, kind) in [
        EscapeKind::DotDot,
        EscapeKind::SymlinkParent,
        EscapeKind::AbsoluteSymlinkParent,
    ]
    .into_iter()
    .enumerate()
    {
        let img = testimages::escape_image(kind);
        push_image(&target(&reg, "escape"), &img, Some(&format!("e{i}")))
            .await
            .unwrap();
        let e = pull(&mut c, &format!("{}/escape:e{i}", reg.host()), None)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("escapes"), "{}", e.message());
        assert_store_empty(&v);
    }
    // Nothing was written outside the store either.
    let mut stack = vec![v.dir.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            assert!(
                !e.file_name().to_string_lossy().contains("escaped"),
                "{:?}",
                e.path()
            );
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    assert!(!Path::new("/tmp/escaped").exists());
}

/// The layers of one pull share a byte bound (`images.max_image_bytes`) beside each layer's
/// own: two 6 MiB layers under an 8 MiB per-layer bound fail a 10 MiB image bound, naming it,
/// and leave nothing; one such layer alone pulls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_past_its_byte_bound_fails_and_leaves_nothing() {
    let reg = registry(RegistryOptions::default());
    let layer = |name: &str| {
        let mut l = testimages::LayerBuilder::new();
        l.file(name, 0o644, &vec![0x5a; 6 << 20]);
        (l.finish(), Compression::Gzip)
    };
    let run = vessel_images::oci::RunConfig::default();
    let amd64 = testimages::linux("amd64", None);
    let two = testimages::image(vec![layer("a"), layer("b")], run.clone(), amd64.clone());
    let one = testimages::image(vec![layer("c")], run, amd64);
    push_image(&target(&reg, "big"), &two, Some("two"))
        .await
        .unwrap();
    push_image(&target(&reg, "big"), &one, Some("one"))
        .await
        .unwrap();
    let v = vesseld("[images]\nmax_layer_bytes = 8388608\nmax_image_bytes = 10485760\n");
    let mut c = v.client().await;
    let e = pull(&mut c, &format!("{}/big:two", reg.host()), None)
        .await
        .unwrap_err();
    assert!(
        e.message().contains("images.max_image_bytes"),
        "{:?}: {}",
        e.code(),
        e.message()
    );
    assert!(list(&mut c).await.is_empty());
    assert!(dir_entries(&v.root_dir().join("images/tmp")).is_empty());
    assert!(dir_entries(&v.root_dir().join("images/records")).is_empty());
    pull(&mut c, &format!("{}/big:one", reg.host()), None)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pulls_share_one_download() {
    let reg = registry(RegistryOptions::default());
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&target(&reg, "shared"), &img, Some("v1"))
        .await
        .unwrap();
    let v = vesseld("");
    let name = format!("{}/shared:v1", reg.host());
    let mut c1 = v.client().await;
    let mut c2 = v.client().await;
    let (a, b) = tokio::join!(pull(&mut c1, &name, None), pull(&mut c2, &name, None));
    assert_eq!(a.unwrap(), img.id().to_string());
    assert_eq!(b.unwrap(), img.id().to_string());
    let layer = img.layers[0].digest();
    // The access log is written after each response; give it a moment, then count.
    let n = reg.wait_blob_get_count(&layer, 1, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(reg.blob_get_count(&layer), 1, "layer fetched {n} times");
    assert_eq!(reg.blob_get_count(&img.config.digest()), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_semantics_and_fs_info() {
    let reg = registry(RegistryOptions::default());
    let img = testimages::busybox_image(Compression::Gzip);
    let t = target(&reg, "rm");
    push_image(&t, &img, Some("a")).await.unwrap();
    push_image(&t, &img, Some("b")).await.unwrap();
    let v = vesseld("");
    let mut c = v.client().await;
    let h = reg.host();
    let (empty_bytes, empty_inodes) = fs_used(&mut c).await;

    let id = pull(&mut c, &format!("{h}/rm:a"), None).await.unwrap();
    pull(&mut c, &format!("{h}/rm:b"), None).await.unwrap();
    let (bytes, inodes) = fs_used(&mut c).await;
    let layer_bytes: u64 = img.layers.iter().map(|l| l.size()).sum();
    // Compressed blob plus the unpacked busybox (~2 MB).
    assert!(
        bytes > empty_bytes + layer_bytes + 1_500_000,
        "{bytes} vs {empty_bytes}"
    );
    assert!(inodes > empty_inodes + 10, "{inodes} vs {empty_inodes}");

    // By one tag: the image goes with every tag it has (the CRI's contract, containerd's).
    remove(&mut c, &format!("{h}/rm:a")).await;
    assert!(status(&mut c, &id).await.is_none());
    assert!(status(&mut c, &format!("{h}/rm:b")).await.is_none());
    assert!(list(&mut c).await.is_empty());
    assert_store_empty(&v);
    assert_eq!(fs_used(&mut c).await.1, empty_inodes);

    // By ID: every tag at once.
    pull(&mut c, &format!("{h}/rm:a"), None).await.unwrap();
    pull(&mut c, &format!("{h}/rm:b"), None).await.unwrap();
    remove(&mut c, &id).await;
    assert!(list(&mut c).await.is_empty());
    assert_store_empty(&v);

    // By repo digest: the whole image too.
    pull(&mut c, &format!("{h}/rm:a"), None).await.unwrap();
    remove(&mut c, &format!("{h}/rm@{}", img.manifest_digest())).await;
    assert!(status(&mut c, &id).await.is_none());
    assert!(status(&mut c, &format!("{h}/rm:a")).await.is_none());
    assert_store_empty(&v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_survives_kill9_restart() {
    let reg = registry(RegistryOptions::default());
    let img = testimages::busybox_image(Compression::Gzip);
    push_image(&target(&reg, "keep"), &img, Some("v1"))
        .await
        .unwrap();
    let mut v = vesseld("");
    let name = format!("{}/keep:v1", reg.host());
    {
        let mut c = v.client().await;
        pull(&mut c, &name, None).await.unwrap();
    }
    let before = {
        let mut c = v.client().await;
        list(&mut c).await
    };
    // Debris a crash could leave: a half-written blob of a dead process.
    let debris = v.root_dir().join("images/tmp/2147483632.blob.1.tmp");
    std::fs::write(&debris, b"partial").unwrap();
    // What a crash between a pull's writes and its durability barrier leaves: a blob and a
    // layer that no record references (and whose content may not have reached the disk).
    let orphan_blob = v
        .root_dir()
        .join("images/blobs/sha256")
        .join("ab".repeat(32));
    std::fs::write(&orphan_blob, b"unsynced").unwrap();
    let orphan_layer = v.root_dir().join("images/layers").join("cd".repeat(32));
    std::fs::create_dir_all(orphan_layer.join("etc")).unwrap();
    v.kill9();
    v.restart().unwrap();
    let mut c = v.client().await;
    assert!(
        !orphan_blob.exists(),
        "unreferenced blob survived a restart"
    );
    assert!(
        !orphan_layer.exists(),
        "unreferenced layer survived a restart"
    );
    let after = list(&mut c).await;
    assert_eq!(before, after);
    assert!(status(&mut c, &name).await.is_some());
    assert!(!debris.exists(), "crash debris was not cleaned at start");
    // Pulling again downloads nothing new.
    pull(&mut c, &name, None).await.unwrap();
    assert_eq!(reg.blob_get_count(&img.layers[0].digest()), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_import_oci_layout_and_docker_archive() {
    let v = vesseld("");
    let mut c = v.client().await;
    let work = tempfile::tempdir().unwrap();

    // OCI layout tarball of a multi-arch index, named by its ref.name annotation.
    let art = testimages::multiarch_index();
    let oci = work.path().join("multi.oci.tar");
    std::fs::write(
        &oci,
        testimages::oci_layout_tar(&art, "registry.local/multi:v1"),
    )
    .unwrap();
    let (ok, out) = v.run_cli(&["image", "import", oci.to_str().unwrap()]);
    assert!(ok, "{out}");
    let s = status(&mut c, "registry.local/multi:v1")
        .await
        .expect("imported image");
    assert_eq!(s.id, art.images()[0].id().to_string());
    assert_eq!(
        s.repo_digests,
        vec![format!("registry.local/multi@{}", art.top_digest())]
    );

    // docker save archive, gzip-compressed as `docker save | gzip` makes it.
    let img = testimages::user_image("vessel");
    let raw = testimages::docker_archive_tar(&img, &["myapp:1.0"]);
    let gz = testimages::compress(&raw, Compression::Gzip);
    let arch = work.path().join("app.tar.gz");
    std::fs::write(&arch, &gz.data).unwrap();
    let (ok, out) = v.run_cli(&[
        "image",
        "import",
        arch.to_str().unwrap(),
        "--tag",
        "registry.local/extra:tag",
    ]);
    assert!(ok, "{out}");
    let s = status(&mut c, "myapp:1.0")
        .await
        .expect("imported docker archive");
    assert_eq!(s.id, img.id().to_string());
    assert_eq!(s.username, "vessel");
    assert!(s
        .repo_tags
        .contains(&"docker.io/library/myapp:1.0".to_string()));
    assert!(s
        .repo_tags
        .contains(&"registry.local/extra:tag".to_string()));
    assert!(s.repo_digests.is_empty());

    // An index entry that names no platform is imported only where its image's config
    // says it runs: an arm64 image is refused on this amd64 node, as a pull refuses it.
    let arm = testimages::platformless_index(vec![testimages::arm64_image()]);
    let arm_tar = work.path().join("arm.oci.tar");
    std::fs::write(
        &arm_tar,
        testimages::oci_layout_tar(&arm, "registry.local/arm:v1"),
    )
    .unwrap();
    let (ok, out) = v.run_cli(&["image", "import", arm_tar.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert!(out.contains("linux/arm64"), "{out}");
    assert!(status(&mut c, "registry.local/arm:v1").await.is_none());
    // Nor listed by the layout's index.json itself (docker 25's, skopeo's shape), nor in a
    // docker archive, where only its config says what it is.
    let arm_img = testimages::arm64_image();
    let direct = work.path().join("arm-direct.oci.tar");
    std::fs::write(
        &direct,
        testimages::oci_layout_tar(
            &testimages::Artifact::Image(arm_img.clone()),
            "registry.local/arm:direct",
        ),
    )
    .unwrap();
    let docker = work.path().join("arm.docker.tar");
    std::fs::write(
        &docker,
        testimages::docker_archive_tar(&arm_img, &["registry.local/arm:docker"]),
    )
    .unwrap();
    for (file, name) in [
        (&direct, "registry.local/arm:direct"),
        (&docker, "registry.local/arm:docker"),
    ] {
        let (ok, out) = v.run_cli(&["image", "import", file.to_str().unwrap()]);
        assert!(!ok, "{out}");
        assert!(out.contains("linux/arm64"), "{out}");
        assert!(status(&mut c, name).await.is_none(), "{name}");
    }
    // ... and one whose config says linux/amd64 is imported.
    let any = testimages::platformless_index(vec![testimages::busybox_image(Compression::Gzip)]);
    let any_tar = work.path().join("any.oci.tar");
    std::fs::write(
        &any_tar,
        testimages::oci_layout_tar(&any, "registry.local/any:v1"),
    )
    .unwrap();
    let (ok, out) = v.run_cli(&["image", "import", any_tar.to_str().unwrap()]);
    assert!(ok, "{out}");
    let s = status(&mut c, "registry.local/any:v1")
        .await
        .expect("imported platform-less entry");
    assert_eq!(s.id, any.images()[0].id().to_string());

    // A garbage file is refused and leaves nothing.
    let junk = work.path().join("junk.tar");
    std::fs::write(&junk, b"not a tarball at all").unwrap();
    let (ok, out) = v.run_cli(&["image", "import", junk.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert_eq!(list(&mut c).await.len(), 2);
    let tmp = dir_entries(&v.root_dir().join("images/tmp"));
    assert!(tmp.is_empty(), "{tmp:?}");

    // Everything the imports brought is removable, down to an empty store.
    for i in list(&mut c).await {
        remove(&mut c, &i.id).await;
    }
    assert_store_empty(&v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_cli_and_metrics() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_vesseld"));
    let out = std::process::Command::new(&bin)
        .args(["config", "default"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("socket = \"/run/vessel/vessel.sock\""));
    // A config with a typo is refused with the key named.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[daemon]\nsokcet = \"/x\"\n").unwrap();
    let out = std::process::Command::new(&bin)
        .args(["--config", bad.to_str().unwrap(), "config", "check"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sokcet"));
    // Drop-ins beside the file are merged over it in name order; `config dump` says so.
    let main = dir.path().join("vessel.toml");
    std::fs::write(&main, "[daemon]\nlog_level = \"info\"\n").unwrap();
    std::fs::create_dir(dir.path().join("config.d")).unwrap();
    std::fs::write(
        dir.path().join("config.d/50-debug.toml"),
        "[daemon]\nlog_level = \"debug\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(&bin)
        .args(["--config", main.to_str().unwrap(), "config", "dump"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("config.d/50-debug.toml"), "{text}");
    assert!(text.contains("log_level = \"debug\""), "{text}");

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let reg = registry(RegistryOptions::default());
    push_image(
        &target(&reg, "m"),
        &testimages::busybox_image(Compression::Gzip),
        Some("v1"),
    )
    .await
    .unwrap();
    let v = Vesseld::start_with(&bin, &format!("metrics_address = \"127.0.0.1:{port}\""), "")
        .expect("starting vesseld with metrics");
    let mut c = v.client().await;
    pull(&mut c, &format!("{}/m:v1", reg.host()), None)
        .await
        .unwrap();
    // A call that fails, counted under its code; a pod, counted by state and backend.
    let e = c
        .runtime
        .container_status(cri::ContainerStatusRequest {
            container_id: "no-such-container".into(),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let pod_cfg = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "metrics".into(),
            uid: "metrics-uid".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        ..Default::default()
    };
    let pod = c.run_pod(&pod_cfg, "flat").await.unwrap();
    let resp = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap();
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"),
        "{:?}",
        resp.headers()
    );
    let m = common::Metrics::parse(resp.text().await.unwrap());
    let want = |name: &str, labels: &[(&str, &str)]| m.want(name, labels);
    assert_eq!(want("vessel_image_pulls_total", &[("result", "ok")]), 1.0);
    assert_eq!(want("vessel_images", &[]), 1.0);
    assert!(want("vessel_image_pulled_bytes_total", &[]) > 0.0);
    assert_eq!(
        want(
            "vessel_cri_requests_total",
            &[("method", "PullImage"), ("code", "OK")]
        ),
        1.0
    );
    assert_eq!(
        want(
            "vessel_cri_requests_total",
            &[("method", "ContainerStatus"), ("code", "NotFound")]
        ),
        1.0
    );
    assert!(
        want(
            "vessel_cri_request_duration_seconds_count",
            &[("method", "PullImage")]
        ) >= 1.0
    );
    assert_eq!(
        want("vessel_pods", &[("state", "ready"), ("backend", "flat")]),
        1.0
    );
    assert_eq!(want("vessel_kvm_usable", &[]), 1.0);
    assert!(want("vessel_image_layers_unpacked_total", &[]) >= 1.0);
    assert_eq!(want("vessel_container_oom_kills_total", &[]), 0.0);
    c.stop_and_remove_pod(&pod).await.unwrap();
    let missing = reqwest::get(format!("http://127.0.0.1:{port}/nope"))
        .await
        .unwrap();
    assert_eq!(missing.status().as_u16(), 404);
}

/// A registry (on loopback, plain HTTP) that serves one image but sends only half of its
/// layer and then nothing, holding the connection open.
async fn stalling_registry(img: testimages::BuiltImage) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let img = std::sync::Arc::new(img);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let img = img.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 << 10];
                let Ok(n) = s.read(&mut buf).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                let mut words = head.split_whitespace();
                let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
                if method != "GET" && method != "HEAD" {
                    return; // a TLS handshake: the client then tries plain HTTP
                }
                let config = img.config.digest().to_string();
                let (status, ctype, body, stall): (u16, String, &[u8], bool) = if path == "/v2/" {
                    (200, "application/json".into(), b"{}", false)
                } else if path.contains("/manifests/") {
                    (
                        200,
                        img.manifest.media_type.clone(),
                        &img.manifest.data,
                        false,
                    )
                } else if path.ends_with(&config) {
                    (
                        200,
                        "application/octet-stream".into(),
                        &img.config.data,
                        false,
                    )
                } else if path.contains("/blobs/") {
                    (
                        200,
                        "application/octet-stream".into(),
                        &img.layers[0].data,
                        true,
                    )
                } else {
                    (404, "text/plain".into(), b"", false)
                };
                let hdr = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nDocker-Content-Digest: {}\r\nConnection: close\r\n\r\n",
                    body.len(),
                    img.manifest_digest()
                );
                let _ = s.write_all(hdr.as_bytes()).await;
                if method == "GET" {
                    let end = if stall { body.len() / 2 } else { body.len() };
                    let _ = s.write_all(&body[..end]).await;
                }
                if stall {
                    tokio::time::sleep(Duration::from_secs(120)).await;
                }
            });
        }
    });
    port
}

/// A registry that stops sending in the middle of a layer fails the pull after
/// `images.pull_progress_timeout_secs`, naming the key, and leaves nothing in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_pull_fails_after_the_progress_timeout() {
    let port = stalling_registry(testimages::busybox_image(Compression::Gzip)).await;
    let v = vesseld("[images]\npull_progress_timeout_secs = 2\n");
    let mut c = v.client().await;
    let start = std::time::Instant::now();
    let e = pull(&mut c, &format!("127.0.0.1:{port}/stall:v1"), None)
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        e.message().contains("no progress") && e.message().contains("pull_progress_timeout_secs"),
        "{e:?}"
    );
    assert!(took < Duration::from_secs(30), "failed after {took:?}");
    assert!(list(&mut c).await.is_empty());
    assert_store_empty(&v);
}

/// Detaches a mount when dropped (before the daemon's temp directory goes).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

/// Writes 1 MiB chunks to `path` until the filesystem is full.
fn fill(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 1 << 20];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
    // The last pages: small writes until even those fail.
    while f.write_all(&chunk[..4096]).is_ok() {}
}

/// A full disk under root_dir (a 48 MiB tmpfs): a pull fails cleanly (no partial layer,
/// blob or record) and a pod or container that cannot be written fails without leaving
/// anything; the image pulled before is intact, and once space is back the same pull and a
/// container from the old image work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_pulls_and_creates_cleanly() {
    if !rustix::process::geteuid().is_root() {
        println!("SKIP a_full_disk_fails_pulls_and_creates_cleanly: needs root (tmpfs)");
        return;
    }
    use vessel_critest::client::{pod_metadata, sh_container};
    let reg = registry(RegistryOptions::default());
    let busybox = testimages::busybox_image(Compression::Gzip);
    push_image(&target(&reg, "library/busybox"), &busybox, Some("latest"))
        .await
        .unwrap();
    let mut l = testimages::LayerBuilder::new();
    l.file("big", 0o644, &vec![0x5a; 8 << 20]);
    let big = testimages::image(
        vec![(l.finish(), Compression::Gzip)],
        vessel_images::oci::RunConfig::default(),
        testimages::linux("amd64", None),
    );
    push_image(&target(&reg, "big"), &big, Some("v1"))
        .await
        .unwrap();

    let mut v = vesseld("");
    v.stop();
    let root = v.root_dir();
    std::fs::create_dir_all(&root).unwrap();
    rustix::mount::mount(
        "vessel-test",
        &root,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        Some(c"size=48m"),
    )
    .unwrap();
    let _unmount = Unmount(root.clone());
    v.restart().unwrap();
    let mut c = v.client().await;
    let bb = format!("{}/library/busybox:latest", reg.host());
    pull(&mut c, &bb, None).await.unwrap();

    // A pod made before the disk fills up.
    let logs = tempfile::tempdir().unwrap();
    let pcfg = |name: &str| cri::PodSandboxConfig {
        metadata: pod_metadata(name, "e2e"),
        log_directory: logs.path().join(name).display().to_string(),
        ..Default::default()
    };
    let (before, before_cfg) = (
        c.run_pod(&pcfg("before"), "").await.unwrap(),
        pcfg("before"),
    );
    let pod_dirs = dir_entries(&root.join("pods"));

    let filler = root.join("filler");
    fill(&filler);
    let e = pull(&mut c, &format!("{}/big:v1", reg.host()), None)
        .await
        .unwrap_err();
    assert!(
        e.message().contains("No space left") || e.message().contains("os error 28"),
        "{:?}: {}",
        e.code(),
        e.message()
    );
    assert!(dir_entries(&root.join("images/tmp")).is_empty());
    assert_eq!(list(&mut c).await.len(), 1, "only busybox is listed");

    // A new pod cannot be written: it fails whole. A container in the old pod: if it
    // cannot be written, it fails whole too.
    let e = c.run_pod(&pcfg("full"), "").await.unwrap_err();
    assert!(e.message().contains("No space left"), "{}", e.message());
    assert_eq!(dir_entries(&root.join("pods")), pod_dirs);
    let created = c
        .create_container(&before, &before_cfg, sh_container("c", &bb, "sleep 1000"))
        .await;
    println!(
        "CreateContainer on a full disk: {:?}",
        created.as_ref().map_err(|e| e.message().to_string())
    );
    if created.is_err() {
        assert!(dir_entries(&root.join("containers")).is_empty());
        assert!(dir_entries(&root.join("images/snapshots")).is_empty());
    }
    c.stop_and_remove_pod(&before).await.unwrap();
    assert!(dir_entries(&root.join("pods")).is_empty());
    assert!(dir_entries(&root.join("containers")).is_empty());
    assert!(dir_entries(&root.join("images/snapshots")).is_empty());

    // Space back: the same pull works, and the old image runs.
    std::fs::remove_file(&filler).unwrap();
    pull(&mut c, &format!("{}/big:v1", reg.host()), None)
        .await
        .unwrap();
    let after = pcfg("after");
    let pod = c.run_pod(&after, "").await.unwrap();
    let ctr = c
        .create_container(&pod, &after, sh_container("c", &bb, "sleep 1000"))
        .await
        .unwrap();
    c.start_container(&ctr).await.unwrap();
    let r = c
        .exec_sync(&ctr, &["sh", "-c", "echo ok"], 10)
        .await
        .unwrap();
    assert_eq!(r.stdout, b"ok\n");
    c.stop_and_remove_pod(&pod).await.unwrap();
    v.stop();
}

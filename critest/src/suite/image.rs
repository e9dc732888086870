//! Image manager: pull by tag, digest and without a tag; list; status; remove across tags;
//! the uid and username fields. Each spec uses its own image (a distinct image id), so
//! removing one never touches another spec's.

use super::ctx::spec as ispec;
use super::{spec, Ctx, Spec, SpecResult, Stop};
use crate::{check, fail};
use vessel_cri_api::v1 as cri;

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("image", "pull by tag, status, remove", by_tag),
        spec!("image", "pull by digest", by_digest),
        spec!("image", "pull without a tag means :latest", no_tag),
        spec!(
            "image",
            "list includes a pulled image with its tags and digests",
            list
        ),
        spec!(
            "image",
            "remove by id or by one tag removes every tag of the image",
            remove_across_tags
        ),
        spec!(
            "image",
            "status of an image that is not there is empty, not an error",
            missing_status
        ),
        spec!(
            "image",
            "pulling an image the registry does not have fails",
            missing_pull
        ),
        spec!("image", "status reports uid for a numeric User", uid_field),
        spec!(
            "image",
            "status reports username for a named User",
            username_field
        ),
    ]
}

async fn status(c: &Ctx, name: &str) -> Result<Option<cri::Image>, Stop> {
    let mut cl = c.c.clone();
    Ok(cl
        .images
        .image_status(cri::ImageStatusRequest {
            image: ispec(name),
            verbose: false,
        })
        .await?
        .into_inner()
        .image)
}

async fn remove(c: &Ctx, name: &str) -> SpecResult {
    let mut cl = c.c.clone();
    cl.images
        .remove_image(cri::RemoveImageRequest { image: ispec(name) })
        .await?;
    Ok(())
}

async fn by_tag(c: Ctx) -> SpecResult {
    let (repo, digest) = c.env.images.variant("bytag");
    let name = format!("{repo}:a");
    let r = c.pull(&name).await?;
    check!(!r.is_empty(), "empty image_ref");
    let Some(img) = status(&c, &name).await? else {
        fail!("ImageStatus after pull: none")
    };
    check!(
        img.repo_tags.contains(&name),
        "repo_tags {:?} lack {name}",
        img.repo_tags
    );
    check!(
        img.repo_digests.contains(&format!("{repo}@{digest}")),
        "repo_digests {:?} lack {repo}@{digest}",
        img.repo_digests
    );
    check!(img.size > 0, "size 0");
    check!(
        img.id.starts_with("sha256:") || !img.id.is_empty(),
        "id {:?}",
        img.id
    );
    remove(&c, &name).await?;
    check!(
        status(&c, &name).await?.is_none(),
        "ImageStatus after remove still finds it"
    );
    Ok(())
}

async fn by_digest(c: Ctx) -> SpecResult {
    let (repo, digest) = c.env.images.variant("bydigest");
    let name = format!("{repo}@{digest}");
    c.pull(&name).await?;
    let Some(img) = status(&c, &name).await? else {
        fail!("ImageStatus by digest after pull: none")
    };
    check!(
        img.repo_digests.contains(&name),
        "repo_digests {:?} lack {name}",
        img.repo_digests
    );
    remove(&c, &name).await?;
    // Tagged and digested (kubelet's pinned images): pulled by the digest, and the tag is
    // not taken (it may name another image in the registry by now), as containerd does.
    let pinned = format!("{repo}:pinned@{digest}");
    c.pull(&pinned).await?;
    let Some(img) = status(&c, &pinned).await? else {
        fail!("ImageStatus {pinned} after pull: none")
    };
    check!(
        img.repo_tags.is_empty() && img.repo_digests.contains(&name),
        "after a pull of {pinned}: repo_tags {:?}, repo_digests {:?}",
        img.repo_tags,
        img.repo_digests
    );
    let tag = format!("{repo}:pinned");
    check!(
        status(&c, &tag).await?.is_none(),
        "{tag} names an image after a pull of {pinned}"
    );
    remove(&c, &pinned).await?;
    Ok(())
}

async fn no_tag(c: Ctx) -> SpecResult {
    let (repo, _) = c.env.images.variant("notag");
    c.pull(&repo).await?;
    let latest = format!("{repo}:latest");
    let Some(img) = status(&c, &latest).await? else {
        fail!("ImageStatus {latest}: none")
    };
    check!(
        img.repo_tags.contains(&latest),
        "repo_tags {:?} lack {latest}",
        img.repo_tags
    );
    let Some(_) = status(&c, &repo).await? else {
        fail!("ImageStatus {repo} (no tag): none")
    };
    remove(&c, &repo).await?;
    Ok(())
}

async fn list(c: Ctx) -> SpecResult {
    let (repo, digest) = c.env.images.variant("list");
    let name = format!("{repo}:a");
    c.pull(&name).await?;
    let mut cl = c.c.clone();
    let imgs = cl
        .images
        .list_images(cri::ListImagesRequest { filter: None })
        .await?
        .into_inner()
        .images;
    let Some(img) = imgs.iter().find(|i| i.repo_tags.contains(&name)) else {
        fail!("ListImages lacks {name}")
    };
    check!(
        img.repo_digests.contains(&format!("{repo}@{digest}")),
        "repo_digests {:?}",
        img.repo_digests
    );
    let filtered = cl
        .images
        .list_images(cri::ListImagesRequest {
            filter: Some(cri::ImageFilter {
                image: ispec(&name),
            }),
        })
        .await?
        .into_inner()
        .images;
    check!(
        filtered.len() == 1 && filtered[0].repo_tags.contains(&name),
        "filtered list {:?}",
        filtered.iter().map(|i| &i.repo_tags).collect::<Vec<_>>()
    );
    Ok(())
}

async fn remove_across_tags(c: Ctx) -> SpecResult {
    let (repo, _) = c.env.images.variant("tags");
    let (a, b) = (format!("{repo}:a"), format!("{repo}:b"));
    c.pull(&a).await?;
    c.pull(&b).await?;
    let Some(ia) = status(&c, &a).await? else {
        fail!("no {a}")
    };
    let Some(ib) = status(&c, &b).await? else {
        fail!("no {b}")
    };
    check!(
        ia.id == ib.id,
        "two tags of one image have ids {} and {}",
        ia.id,
        ib.id
    );
    check!(
        ia.repo_tags.contains(&a) && ia.repo_tags.contains(&b),
        "repo_tags {:?}",
        ia.repo_tags
    );
    remove(&c, &ia.id).await?;
    check!(
        status(&c, &a).await?.is_none(),
        "{a} still there after removing the id"
    );
    check!(
        status(&c, &b).await?.is_none(),
        "{b} still there after removing the id"
    );
    // By one tag: the image goes with its other tags (the CRI's contract, containerd's).
    c.pull(&a).await?;
    c.pull(&b).await?;
    remove(&c, &a).await?;
    check!(
        status(&c, &b).await?.is_none(),
        "{b} still there after removing {a}"
    );
    Ok(())
}

async fn missing_status(c: Ctx) -> SpecResult {
    let name = format!("{}/vessel-critest/none:missing", c.env.registry);
    check!(
        status(&c, &name).await?.is_none(),
        "ImageStatus found an image never pulled"
    );
    Ok(())
}

async fn missing_pull(c: Ctx) -> SpecResult {
    let name = format!("{}/vessel-critest/none:missing", c.env.registry);
    match c.pull(&name).await {
        Err(_) => Ok(()),
        Ok(r) => fail!("pulling a missing image returned {r}"),
    }
}

async fn uid_field(c: Ctx) -> SpecResult {
    let name = c.env.images.user_uid.clone();
    c.pull(&name).await?;
    let Some(img) = status(&c, &name).await? else {
        fail!("no {name}")
    };
    check!(
        img.uid.as_ref().map(|u| u.value) == Some(1000),
        "uid {:?}, want 1000",
        img.uid
    );
    check!(
        img.username.is_empty(),
        "username {:?}, want empty",
        img.username
    );
    // `crictl inspecti` shows the image's OCI config as containerd and CRI-O do.
    let mut cl = c.c.clone();
    let info = cl
        .images
        .image_status(cri::ImageStatusRequest {
            image: ispec(&name),
            verbose: true,
        })
        .await?
        .into_inner()
        .info;
    let info: serde_json::Value = info
        .get("info")
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default();
    check!(
        info["imageSpec"]["config"]["User"] == "1000",
        "verbose ImageStatus info.imageSpec.config: {}",
        info["imageSpec"]["config"]
    );
    Ok(())
}

async fn username_field(c: Ctx) -> SpecResult {
    let name = c.env.images.user_name.clone();
    c.pull(&name).await?;
    let Some(img) = status(&c, &name).await? else {
        fail!("no {name}")
    };
    check!(
        img.username == "vessel",
        "username {:?}, want vessel",
        img.username
    );
    check!(img.uid.is_none(), "uid {:?}, want none", img.uid);
    Ok(())
}

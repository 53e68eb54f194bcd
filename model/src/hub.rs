//! Models and datasets by their Hugging Face Hub id (`gpt2`, `openai-community/gpt2`,
//! `org/name@revision`), found in the cache that Python's `huggingface_hub` shares
//! (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`) and downloaded into it
//! with the `hf-hub` crate when missing. `HF_ENDPOINT` names another Hub, `HF_TOKEN` (else
//! `HF_HOME/token`) authenticates, and `HF_HUB_OFFLINE=1` forbids the network: then only the cache
//! is read, and a repository that is not in it is an error naming the id.
//!
//! A download goes to a temporary file beside its blob and is renamed into place whole
//! (`hf-hub`'s own protocol, the same layout as `huggingface_hub`: `blobs/`, `snapshots/COMMIT/`
//! links, `refs/REVISION`), so an interrupted download leaves nothing a reader would take.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, Result};

/// The Hub's address unless `HF_ENDPOINT` says otherwise.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A repository on the Hub at a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// `org/name`, or a bare `name` (the Hub's canonical models, e.g. `gpt2`).
    pub repo: String,
    /// A branch, tag or commit; `main` unless `@revision` gave one.
    pub revision: String,
    pub kind: RepoKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoKind {
    Model,
    Dataset,
}

impl HubId {
    /// `name`, `org/name` or either with `@revision`, as `from_pretrained` takes them; `None`
    /// for anything else (a path with more parts, an empty part, spaces).
    pub fn parse(name: &str, kind: RepoKind) -> Option<Self> {
        let (repo, revision) = match name.split_once('@') {
            Some((repo, rev)) if !rev.is_empty() => (repo, rev),
            Some(_) => return None,
            None => (name, "main"),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let valid = |p: &str| {
            !p.is_empty() && p != "." && p != ".." && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if parts.is_empty() || parts.len() > 2 || !parts.iter().all(|p| valid(p)) {
            return None;
        }
        Some(Self {
            repo: repo.to_string(),
            revision: revision.to_string(),
            kind,
        })
    }

    fn repo(&self) -> Repo {
        let kind = match self.kind {
            RepoKind::Model => RepoType::Model,
            RepoKind::Dataset => RepoType::Dataset,
        };
        Repo::with_revision(self.repo.clone(), kind, self.revision.clone())
    }

    /// The repository's folder in the cache (`models--org--name`).
    pub fn cache_folder(&self) -> PathBuf {
        cache_dir().join(self.repo().folder_name())
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.kind == RepoKind::Dataset {
            f.write_str("datasets/")?;
        }
        f.write_str(&self.repo)?;
        if self.revision != "main" {
            write!(f, "@{}", self.revision)?;
        }
        Ok(())
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `HF_HOME`, else `XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
fn hf_home() -> PathBuf {
    if let Some(home) = env("HF_HOME") {
        return PathBuf::from(home);
    }
    let cache = env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache"));
    cache.join("huggingface")
}

/// The Hub cache shared with `huggingface_hub`: `HF_HUB_CACHE` (or the older
/// `HUGGINGFACE_HUB_CACHE`), else `HF_HOME/hub`.
pub fn cache_dir() -> PathBuf {
    env("HF_HUB_CACHE")
        .or_else(|| env("HUGGINGFACE_HUB_CACHE"))
        .map(PathBuf::from)
        .unwrap_or_else(|| hf_home().join("hub"))
}

/// `HF_HUB_OFFLINE` is set to a true value (`1`, `true`, `yes`, `on`).
pub fn offline() -> bool {
    env("HF_HUB_OFFLINE").is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// `HF_ENDPOINT` without a trailing slash, else the Hub.
pub fn endpoint() -> String {
    env("HF_ENDPOINT")
        .map(|e| e.trim_end_matches('/').to_string())
        .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
}

/// `HF_TOKEN`, else the token file `huggingface-cli login` writes (`HF_TOKEN_PATH`, else
/// `HF_HOME/token`).
fn token() -> Option<String> {
    env("HF_TOKEN").or_else(|| {
        let path = env("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home().join("token"));
        std::fs::read_to_string(path)
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
    })
}

/// The files of a repository at its revision, as the cache or the Hub has them.
pub struct Snapshot {
    pub id: HubId,
    /// `snapshots/COMMIT/` in the cache: the files (links to blobs) under their names in the
    /// repository, a directory like any other.
    pub dir: PathBuf,
    /// Every file of the repository at that revision (downloaded or not).
    pub files: Vec<String>,
    api: Option<hf_hub::api::sync::ApiRepo>,
}

impl Snapshot {
    /// The repository's listing, from the Hub (its commit for the revision and its files), or
    /// offline from the cache's snapshot for the revision. Downloads nothing yet.
    pub fn open(id: &HubId) -> Result<Self> {
        if offline() {
            return Self::cached(id);
        }
        let api = ApiBuilder::from_cache(Cache::new(cache_dir()))
            .with_endpoint(endpoint())
            .with_token(token())
            .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .build()
            .map_err(|e| hub_error(id, e))?
            .repo(id.repo());
        let info = api.info().map_err(|e| hub_error(id, e))?;
        let dir = id.cache_folder().join("snapshots").join(&info.sha);
        Ok(Self {
            id: id.clone(),
            dir,
            files: info.siblings.into_iter().map(|s| s.rfilename).collect(),
            api: Some(api),
        })
    }

    /// The snapshot the cache holds for the revision (`refs/REVISION`, or the revision itself
    /// when it is a commit), with the files it holds.
    fn cached(id: &HubId) -> Result<Self> {
        let folder = id.cache_folder();
        let commit = std::fs::read_to_string(folder.join("refs").join(&id.revision))
            .map(|c| c.trim().to_string())
            .unwrap_or_else(|_| id.revision.clone());
        let dir = folder.join("snapshots").join(&commit);
        if !dir.is_dir() {
            return Err(Error::Hub {
                id: id.to_string(),
                reason: format!(
                    "not in the cache ({}) and HF_HUB_OFFLINE is set: download it first (unset HF_HUB_OFFLINE, or \
                     `huggingface-cli download {}`), or set HF_HUB_CACHE to the cache that has it",
                    folder.display(),
                    id.repo
                ),
            });
        }
        let mut files = Vec::new();
        list_files(&dir, &dir, &mut files).map_err(|e| Error::io(&dir, e))?;
        files.sort();
        Ok(Self {
            id: id.clone(),
            dir,
            files,
            api: None,
        })
    }

    pub fn has(&self, file: &str) -> bool {
        self.files.iter().any(|f| f == file)
    }

    /// `file` in the cache, downloaded first if it is not there (offline: an error naming it).
    pub fn get(&self, file: &str) -> Result<PathBuf> {
        let local = self.dir.join(file);
        if local.exists() {
            return Ok(local);
        }
        match &self.api {
            Some(api) => api.download(file).map_err(|e| hub_error(&self.id, e).in_file(file)),
            None => Err(Error::Hub {
                id: self.id.to_string(),
                reason: format!("{file} is not in the cache and HF_HUB_OFFLINE is set"),
            }),
        }
    }
}

fn list_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            list_files(root, &path, out)?;
        } else if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(())
}

/// What a failed Hub request means for the user, naming the id.
fn hub_error(id: &HubId, err: ApiError) -> Error {
    let reason = match &err {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(404, _) => format!(
                "no such repository or revision on {} (check the id; a private repository also answers 404 \
                 without a token: set HF_TOKEN)",
                endpoint()
            ),
            ureq::Error::Status(401 | 403, _) => format!(
                "{} refused access: the repository is gated or private; set HF_TOKEN to a token that may read \
                 it (and accept its terms on the Hub)",
                endpoint()
            ),
            ureq::Error::Status(code, _) => format!("{} answered HTTP {code}", endpoint()),
            ureq::Error::Transport(t) => format!(
                "cannot reach {} ({t}); check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the \
                 cache only",
                endpoint()
            ),
        },
        ApiError::TooManyRetries(inner) => format!("the download failed repeatedly: {inner}"),
        other => other.to_string(),
    };
    Error::Hub {
        id: id.to_string(),
        reason,
    }
}

impl Error {
    /// The error of a download, naming the file too.
    fn in_file(self, file: &str) -> Self {
        match self {
            Error::Hub { id, reason } => Error::Hub {
                id,
                reason: format!("{file}: {reason}"),
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_as_from_pretrained_takes_them() {
        let id = HubId::parse("gpt2", RepoKind::Model).unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("gpt2", "main"));
        let id = HubId::parse("openai-community/gpt2@v1.0", RepoKind::Model).unwrap();
        assert_eq!(
            (id.repo.as_str(), id.revision.as_str()),
            ("openai-community/gpt2", "v1.0")
        );
        assert_eq!(id.to_string(), "openai-community/gpt2@v1.0");
        for bad in ["", "a/b/c", "a//b", "a b", "org/name@", "../x", "/abs"] {
            assert!(HubId::parse(bad, RepoKind::Model).is_none(), "{bad:?}");
        }
        let id = HubId::parse("org/set", RepoKind::Dataset).unwrap();
        assert_eq!(id.to_string(), "datasets/org/set");
        assert!(id.cache_folder().ends_with("datasets--org--set"));
    }
}

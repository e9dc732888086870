//! Helpers of the unit tests.

use std::path::PathBuf;

/// A new temporary directory and the path `name` in it (nothing is made there).
pub fn temp_path(name: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join(name);
    (d, path)
}

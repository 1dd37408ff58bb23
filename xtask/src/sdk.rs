//! The official OpenAI Python SDK for `tests/openai_sdk.rs`: a venv under the target
//! directory with `openai` from PyPI, made once and reused.
//!
//! Without Python, `venv` or network access to PyPI the check cannot run: in CI
//! (`CI` set) that fails `cargo xtask test`; elsewhere it is skipped, saying so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::Result;

fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false")
}

fn runs(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn has_openai(python: &Path) -> bool {
    runs(Command::new(python).args(["-c", "import openai"]))
}

/// A step failed: an error in CI, a skip (with the reason) elsewhere.
fn unavailable(why: &str) -> Result<Option<PathBuf>> {
    if in_ci() {
        return Err(format!("the OpenAI SDK check cannot run in CI: {why}"));
    }
    eprintln!("xtask: {why}; the OpenAI SDK check (tests/openai_sdk.rs) will be SKIPPED");
    Ok(None)
}

/// The venv's python with `openai` importable, installing it when missing.
pub(crate) fn python() -> Result<Option<PathBuf>> {
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".to_owned());
    let venv = std::path::absolute(Path::new(&target).join("openai-sdk-venv"))
        .map_err(|e| format!("cannot resolve the target directory: {e}"))?;
    let python = venv.join("bin").join("python");
    if python.exists() && has_openai(&python) {
        return Ok(Some(python));
    }
    let Some(system) = ["python3", "python"]
        .into_iter()
        .find(|p| runs(Command::new(p).arg("--version")))
    else {
        return unavailable("no python3 on PATH");
    };
    eprintln!("xtask: installing the OpenAI Python SDK into {}", venv.display());
    if !python.exists() && !runs(Command::new(system).args(["-m", "venv"]).arg(&venv)) {
        return unavailable(&format!("`{system} -m venv` failed (python3-venv missing?)"));
    }
    let pip = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "openai",
        ])
        .status();
    if !pip.is_ok_and(|s| s.success()) || !has_openai(&python) {
        return unavailable("`pip install openai` failed");
    }
    Ok(Some(python))
}

//! The facts written beside every result: UTC date, CPU model, core count, command line, the
//! machine's load, and where the measured binaries come from (commit, uncommitted changes,
//! whether each binary was built after the last change to the sources).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// `YYYY-MM-DD` and `YYYY-MM-DDTHH:MM:SSZ` of now, in UTC.
pub fn utc_now() -> (String, String) {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let date = format!("{y:04}-{m:02}-{d:02}");
    let stamp = format!(
        "{date}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    (date, stamp)
}

/// Days since 1970-01-01 → (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `nproc` and the CPU model name from /proc/cpuinfo.
pub fn cpu() -> (usize, String) {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    (n, model)
}

/// The command line as typed (arguments with spaces quoted).
pub fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if a.contains(' ') || a.is_empty() {
                format!("'{a}'")
            } else {
                a
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A Markdown header block: command, machine and date.
pub fn header() -> String {
    let (_, stamp) = utc_now();
    let (n, model) = cpu();
    format!(
        "- command: `{}`\n- machine: nproc {n}, CPU {model}\n- date: {stamp}\n",
        command_line()
    )
}

/// Where the measured binaries come from, read when the run starts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Provenance {
    /// `git rev-parse HEAD` of the source tree (None outside a checkout).
    pub commit: Option<String>,
    /// Tracked files with uncommitted changes (`git status --porcelain`).
    pub dirty: Vec<String>,
    pub binaries: Vec<BinaryInfo>,
    /// `/proc/loadavg` (1, 5, 15 min) at the start: other work sharing the cores.
    pub load_average: Option<String>,
    /// Free-form lines (versions of external routers and the like).
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BinaryInfo {
    pub path: String,
    /// Modification time of the binary, UTC.
    pub built: Option<String>,
    /// Built after the newest change to the sources it is made from (tracked files, their
    /// uncommitted edits included; see `built_from`). A stale binary does not measure the
    /// commit named above.
    pub fresh: Option<bool>,
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim_end().to_owned())
}

/// When `path` was last written, as a UTC stamp (`None` when it cannot be read).
pub fn built_at(path: &Path) -> Option<String> {
    mtime(path).map(utc_stamp)
}

fn mtime(path: &Path) -> Option<u64> {
    let t = std::fs::metadata(path).ok()?.modified().ok()?;
    t.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs())
}

fn utc_stamp(secs: u64) -> String {
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// What a binary is built from (cargo relinks it only when one of these changes); the same
/// table as `bench/provenance.py`.
fn built_from(binary: &str) -> &'static [&'static str] {
    match binary {
        "inferlb" => &["src", "Cargo.toml", "Cargo.lock"],
        "loadgen" => &[
            "crates/loadgen",
            "crates/vllm-sim",
            "Cargo.toml",
            "Cargo.lock",
        ],
        "vllm-sim" => &["crates/vllm-sim", "Cargo.toml", "Cargo.lock"],
        _ => &["src", "crates", "benches", "Cargo.toml", "Cargo.lock"],
    }
}

/// Reads the provenance of `binaries` from the git checkout around the current directory.
pub fn provenance(binaries: &[PathBuf], notes: &[String]) -> Provenance {
    let top = git(&["rev-parse", "--show-toplevel"]).map(PathBuf::from);
    let commit = git(&["rev-parse", "HEAD"]);
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .map(|s| {
            s.lines()
                .filter_map(|l| l.get(3..).map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let newest_source = |paths: &[&str]| {
        let top = top.as_ref()?;
        let mut args = vec!["-C", top.to_str()?, "ls-files", "--"];
        args.extend_from_slice(paths);
        let list = git(&args)?;
        list.lines().filter_map(|f| mtime(&top.join(f))).max()
    };
    let binaries = binaries
        .iter()
        .map(|b| {
            let built = mtime(b);
            let name = b.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let newest_source = newest_source(built_from(name));
            BinaryInfo {
                path: b.display().to_string(),
                built: built.map(utc_stamp),
                fresh: built.zip(newest_source).map(|(b, s)| b >= s),
            }
        })
        .collect();
    let load_average = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    Provenance {
        commit,
        dirty,
        binaries,
        load_average,
        notes: notes.to_vec(),
    }
}

impl Provenance {
    /// Markdown list lines, to follow [`header`].
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let commit = self
            .commit
            .as_deref()
            .unwrap_or("unknown (not a git checkout)");
        let state = if self.dirty.is_empty() {
            "clean".to_owned()
        } else {
            format!(
                "dirty: {} changed file(s): {}",
                self.dirty.len(),
                self.dirty.join(", ")
            )
        };
        s.push_str(&format!("- source: commit {commit} ({state})\n"));
        for b in &self.binaries {
            let fresh = match b.fresh {
                Some(true) => "built after the last source change",
                Some(false) => "STALE: older than the sources, does not measure this commit",
                None => "freshness unknown",
            };
            s.push_str(&format!(
                "- binary: `{}` built {} ({fresh})\n",
                b.path,
                b.built.as_deref().unwrap_or("?")
            ));
        }
        if let Some(l) = &self.load_average {
            let (n, _) = cpu();
            s.push_str(&format!(
                "- load average at start: {l} on {n} cores (anything above 0 is other work \
                 sharing the machine)\n"
            ));
        }
        for n in &self.notes {
            s.push_str(&format!("- {n}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn provenance_names_the_commit_and_a_stale_binary() {
        let dir = std::env::temp_dir().join(format!("loadgen-prov-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let old = dir.join("old-binary");
        std::fs::write(&old, b"x").unwrap();
        let long_ago = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        let p = provenance(&[old], &["router x 1.2".into()]);
        let text = p.markdown();
        if p.commit.is_some() {
            // Inside the repository: the sources are newer than 1970-01-12.
            assert_eq!(p.binaries[0].fresh, Some(false), "{text}");
            assert!(text.contains("STALE"), "{text}");
            assert!(text.contains("- source: commit "), "{text}");
        }
        assert!(text.contains("built 1970-01-12T13:46:40Z"), "{text}");
        assert!(text.contains("- router x 1.2"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }
}

//! The real `inferlb` binary as a child process, with its JSON log read as it is written.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_inferlb");

/// A running binary: the child, its address, and its JSON log lines as they are written.
pub struct Running {
    pub child: std::process::Child,
    pub addr: String,
    pub logs: tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
}

/// A test that fails before stopping its router must not leave the process running (holding
/// ports, and whatever file descriptors it inherited).
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    /// Wait (at most 10 s) for the log line whose message is `message`; earlier lines are
    /// skipped. The log is the process's own account of what it did, so this waits for the
    /// event itself, not for a guess at how long it takes.
    pub async fn log(&mut self, message: &str) -> serde_json::Value {
        let wait = async {
            while let Some(v) = self.logs.recv().await {
                if v["fields"]["message"] == message {
                    return Some(v);
                }
            }
            None
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("no `{message}` log line within 10 s"))
            .unwrap_or_else(|| panic!("the process ended its log without `{message}`"))
    }

    pub fn signal(&self, name: &str) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args([name, &pid])
            .status()
            .unwrap()
            .success());
    }

    /// Wait (at most 10 s) for the process to exit.
    pub async fn exit(mut self) -> std::process::ExitStatus {
        for _ in 0..1_000 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the process did not exit within 10 s");
    }
}

/// Start the binary with `config` as its config file, then `args`: the file is `config.toml`
/// in a directory of its own named for `name` (the caller removes it when done, from the path
/// returned).
pub fn spawn_with_config(name: &str, config: &str, args: &[&str]) -> (Running, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("inferlb-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.toml");
    std::fs::write(&path, config).unwrap();
    let mut all = vec!["--config", path.to_str().unwrap()];
    all.extend_from_slice(args);
    (spawn_with(&all), dir)
}

/// Start the binary with `args` on a free port; returns once it announced its address.
pub fn spawn_with(args: &[&str]) -> Running {
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, logs) = tokio::sync::mpsc::unbounded_channel();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    // Keep draining stdout so the child never blocks on a full pipe; forward JSON log lines.
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // The demo also prints plain lines for people; only JSON log lines matter here.
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if let Some(addr) = v["fields"]["main_addr"].as_str() {
                let _ = addr_tx.send(addr.to_owned());
            }
            let _ = tx.send(v);
        }
    });
    match addr_rx.recv_timeout(Duration::from_secs(30)) {
        Ok(addr) => Running { child, addr, logs },
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the binary never announced its address");
        }
    }
}

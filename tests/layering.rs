//! The configuration flows one way: `src/config.rs` composes the sections the modules own, and
//! no module imports `crate::config` back (a section reports errors through the leaf
//! `crate::config_error`). Only the composition — `lib.rs`, `main.rs`, `reload.rs` — and test
//! code may name the whole file's type. This reads the sources, so a new back-edge fails here
//! instead of growing a circle again (there was one of 19 files).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

/// Files that compose the configuration (they may import it).
const COMPOSERS: &[&str] = &[
    "config.rs",
    "config_tests.rs",
    "lib.rs",
    "main.rs",
    "reload.rs",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without its inline unit-test modules (`#[cfg(test)] mod tests { … }`, braces matched).
fn without_test_modules(text: &str) -> String {
    const START: &str = "#[cfg(test)]\nmod tests {";
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(START) {
        out.push_str(&rest[..at]);
        let body = &rest[at + START.len()..];
        let mut depth = 1usize;
        let mut end = body.len();
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &body[end..];
    }
    out.push_str(rest);
    out
}

/// The lines of `text` that import or name `crate::config` (not `crate::config_error`),
/// outside comments and unit-test modules.
fn back_edges(text: &str) -> Vec<String> {
    without_test_modules(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .filter(|l| {
            l.match_indices("crate::config").any(|(i, _)| {
                let rest = &l[i + "crate::config".len()..];
                !rest.starts_with('_')
            })
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn no_module_imports_the_configuration_it_is_a_section_of() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(files.len() > 50, "found only {} sources", files.len());
    let mut found = Vec::new();
    for file in &files {
        let rel = file
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if COMPOSERS.contains(&rel.as_str())
            || rel.ends_with("_tests.rs")
            || rel.ends_with("/tests.rs")
        {
            continue;
        }
        for line in back_edges(&std::fs::read_to_string(file).unwrap()) {
            found.push(format!("src/{rel}: {}", line.trim()));
        }
    }
    assert!(
        found.is_empty(),
        "modules import crate::config (own your section, report a config_error::ConfigError, \
         or take a view the composer builds):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_back_edge_is_seen() {
    assert_eq!(
        back_edges("use crate::config::Config;\nuse crate::config_error::ConfigError;\n"),
        vec!["use crate::config::Config;".to_owned()]
    );
    assert!(back_edges("// see crate::config\nuse crate::config_error::X;\n").is_empty());
    assert!(
        back_edges("fn a() {}\n#[cfg(test)]\nmod tests {\n use crate::config::Config;\n}\n")
            .is_empty()
    );
}

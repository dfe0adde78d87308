//! Priority classes: which class a request waits in, from its header and its API key's rules.
//!
//! Classes are the names of `priority.classes`, highest first; a request is tagged with the
//! class's index (0 = highest). It asks with the `priority.header` (a class name); it gets
//! `default` when it asks for none or for a name that is not a class, and never a class above
//! its ceiling (`max_class`, per API key or global), so a client cannot promote itself. The
//! capacity queue ([`crate::endpoints::capacity`]) serves higher classes first and sheds lower
//! ones first.

use http::HeaderValue;

use crate::config::PriorityConfig;

/// The priority classes one API key may use (indices into `priority.classes`, 0 = highest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassRule {
    pub default: u8,
    /// The highest class (smallest index) the key may ask for.
    pub max: u8,
}

impl ClassRule {
    /// The global rule of `cfg` (for clients without a key rule of their own).
    pub fn global(cfg: &PriorityConfig) -> Self {
        ClassRule {
            default: cfg.index(&cfg.default_class).unwrap_or(0),
            max: cfg.index(&cfg.max_class).unwrap_or(0),
        }
    }
}

/// The class of a request that asked for `asked` under `rule`.
pub fn class_of(cfg: &PriorityConfig, asked: Option<&HeaderValue>, rule: ClassRule) -> u8 {
    let wanted = asked
        .and_then(|v| v.to_str().ok())
        .and_then(|name| cfg.index(name.trim()))
        .unwrap_or(rule.default);
    // A larger index is a lower class: the ceiling is the smallest index allowed.
    wanted.max(rule.max)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn asked_class_is_capped_by_the_ceiling_and_defaults_apply() {
        let cfg = PriorityConfig::default(); // interactive, standard, batch; default = max = standard
        let global = ClassRule::global(&cfg);
        assert_eq!(global, ClassRule { default: 1, max: 1 });
        let h = |s: &'static str| HeaderValue::from_static(s);
        assert_eq!(class_of(&cfg, None, global), 1);
        assert_eq!(
            class_of(&cfg, Some(&h("batch")), global),
            2,
            "demotion is free"
        );
        assert_eq!(
            class_of(&cfg, Some(&h("interactive")), global),
            1,
            "no self-promotion"
        );
        assert_eq!(
            class_of(&cfg, Some(&h("gold")), global),
            1,
            "unknown → default"
        );
        let vip = ClassRule { default: 1, max: 0 };
        assert_eq!(class_of(&cfg, Some(&h("interactive")), vip), 0);
        assert_eq!(class_of(&cfg, None, vip), 1);
        let batch_key = ClassRule { default: 2, max: 2 };
        assert_eq!(class_of(&cfg, Some(&h("interactive")), batch_key), 2);
    }
}

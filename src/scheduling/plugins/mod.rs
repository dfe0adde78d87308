//! Built-in plugins, one module per purpose. Each module's doc gives its formula and inputs.

pub mod filter;
pub mod picker;
pub mod scorer;

use serde::de::DeserializeOwned;

use crate::config_error::ConfigError;

/// Deserialise a plugin's own `parameters` table (its struct denies unknown keys).
pub fn parameters<T: DeserializeOwned>(name: &str, table: &toml::Table) -> Result<T, ConfigError> {
    toml::Value::Table(table.clone())
        .try_into()
        .map_err(|e: toml::de::Error| {
            ConfigError::invalid(format!("plugins.{name}.parameters"), e.message().to_owned())
        })
}

/// Implements [`Plugin::type_name`](crate::scheduling::framework::Plugin::type_name) and
/// `name` for a struct with a `name: Arc<str>` field and a `TYPE` constant.
macro_rules! identity {
    () => {
        fn type_name(&self) -> &'static str {
            Self::TYPE
        }
        fn name(&self) -> &str {
            &self.name
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    };
}
pub(crate) use identity;

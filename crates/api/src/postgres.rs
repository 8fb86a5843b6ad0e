//! `PostgresDatabase` (`db.opkit.dev/v1alpha1`): a database and its login role on a
//! PostgreSQL server outside the cluster, and a Secret with what an application needs to
//! connect. The server's address and admin credentials come from a Secret in the same
//! namespace, labelled [`SERVER_LABEL`].
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The label a server's Secret must carry (value `"true"`): only such Secrets are read,
/// so the operator neither caches nor needs access to every Secret's contents.
pub const SERVER_LABEL: &str = "db.opkit.dev/server";

/// Desired state: which server, which names, what happens on delete.
// Printer columns repeat `type_ = "string"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "db.opkit.dev",
    version = "v1alpha1",
    kind = "PostgresDatabase",
    doc = "A database and its login role on a PostgreSQL server, with a Secret holding the role's generated password.",
    namespaced,
    status = "PostgresDatabaseStatus",
    shortname = "pgdb",
    category = "opkit",
    printcolumn(name = "Database", type_ = "string", json_path = ".status.database"),
    printcolumn(name = "Role", type_ = "string", json_path = ".status.role"),
    printcolumn(name = "Secret", type_ = "string", json_path = ".status.secretName"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.serverSecret == oldSelf.serverSecret",
        "message": "serverSecret cannot change: the database lives on the server it was made on"
    },
    {
        "rule": "has(self.databaseName) == has(oldSelf.databaseName) && (!has(self.databaseName) || self.databaseName == oldSelf.databaseName)",
        "message": "databaseName cannot change: make a new PostgresDatabase instead"
    },
    {
        "rule": "has(self.roleName) == has(oldSelf.roleName) && (!has(self.roleName) || self.roleName == oldSelf.roleName)",
        "message": "roleName cannot change: make a new PostgresDatabase instead"
    },
    {
        "rule": "!has(oldSelf.passwordRevision) || (has(self.passwordRevision) && self.passwordRevision >= oldSelf.passwordRevision)",
        "message": "passwordRevision can only grow: raise it to make a new password"
    }
]))]
#[serde(rename_all = "camelCase")]
pub struct PostgresDatabaseSpec {
    /// The Secret, in the same namespace and labelled `db.opkit.dev/server: "true"`, with the
    /// server's `host`, `port` (default 5432) and an admin's `username` and `password` (a
    /// superuser, or a role that may create roles and databases and read `pg_authid`);
    /// optionally `sslmode` (disable, prefer (default), require, verify-full) and `ca.crt`.
    #[schemars(schema_with = "crate::postgres::secret_name")]
    pub server_secret: String,
    /// The database's name on the server (default: this object's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::postgres::identifier")]
    pub database_name: Option<String>,
    /// The login role that owns the database (default: the database's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::postgres::role_identifier")]
    pub role_name: Option<String>,
    /// The Secret written for applications (default: `<name>-postgres`): `host`, `port`,
    /// `database`, `username`, `password` and `uri`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::postgres::secret_name")]
    pub secret_name: Option<String>,
    /// What happens to the database and role when this object is deleted: `Retain` (the
    /// default) keeps them, `Delete` drops them. Only what this object made is ever dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim_policy: Option<ReclaimPolicy>,
    /// Raise it to make a new password: the role's password and the Secret change together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub password_revision: Option<i64>,
}

/// What happens on the server when a `PostgresDatabase` is deleted.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ReclaimPolicy {
    /// Keep the database and the role.
    #[default]
    Retain,
    /// Drop the database (closing its connections), then the role.
    Delete,
}

/// Observed state, written only by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PostgresDatabaseStatus {
    /// The database's name on the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<String>,
    /// The role's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The Secret applications read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    /// The `passwordRevision` whose password the role and the Secret have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_revision: Option<i64>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`; `Deleting` while dropping fails.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Schema of a PostgreSQL name the operator makes: refused at admission when the server
/// would refuse or silently truncate it.
pub(crate) fn identifier(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": 63,
        "x-kubernetes-validations": [{
            "rule": "self.matches('^[a-z_][a-z0-9_$-]*$')",
            "message": "must start with a lowercase letter or '_' and hold only lowercase letters, digits, '_', '$' and '-' (at most 63)"
        }]
    })
}

/// Schema of a role's name: an identifier PostgreSQL does not keep for itself (`pg_…`).
pub(crate) fn role_identifier(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = identifier(g);
    if let Some(rules) = schema
        .get_mut("x-kubernetes-validations")
        .and_then(|r| r.as_array_mut())
    {
        rules.push(serde_json::json!({
            "rule": "!self.startsWith('pg_')",
            "message": "must not start with pg_: PostgreSQL keeps those names for its own roles"
        }));
    }
    schema
}

/// Schema of a Secret's name.
pub(crate) fn secret_name(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": 253,
        "x-kubernetes-validations": [{
            "rule": "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",
            "message": "must be a Secret name (lowercase letters, digits, '-' and '.')"
        }]
    })
}

/// The CRD.
pub fn crd() -> CustomResourceDefinition {
    PostgresDatabase::crd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_refused_by_rule_and_fixed_fields_cannot_change() {
        let crd = serde_json::to_value(crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let rules: Vec<&str> = spec["x-kubernetes-validations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["rule"].as_str().unwrap())
            .collect();
        assert_eq!(rules.len(), 4, "{rules:?}");
        assert!(rules[0].contains("serverSecret == oldSelf.serverSecret"));
        assert_eq!(spec["properties"]["databaseName"]["maxLength"], 63);
        let role = &spec["properties"]["roleName"]["x-kubernetes-validations"];
        assert_eq!(role[1]["rule"], "!self.startsWith('pg_')");
        assert_eq!(
            spec["properties"]["reclaimPolicy"]["enum"],
            serde_json::json!(["Retain", "Delete"])
        );
        assert_eq!(spec["required"], serde_json::json!(["serverSecret"]));
    }
}

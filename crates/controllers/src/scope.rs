//! Which namespaces a controller watches.
use kube::{Api, Client, Resource};

/// All namespaces, or a fixed list (one watch per namespace, so RBAC can be namespaced too).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    namespaces: Vec<String>,
}

impl Scope {
    /// Watch every namespace.
    pub fn all() -> Self {
        Scope::default()
    }

    /// Watch only these namespaces; an empty list means all.
    pub fn namespaces(namespaces: Vec<String>) -> Self {
        Scope { namespaces }
    }

    /// One `Api` per watched namespace (or one cluster-wide `Api`).
    pub fn apis<K>(&self, client: &Client) -> Vec<Api<K>>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        if self.namespaces.is_empty() {
            vec![Api::all(client.clone())]
        } else {
            self.namespaces
                .iter()
                .map(|ns| Api::namespaced(client.clone(), ns))
                .collect()
        }
    }

    /// Namespaces to watch; `None` for all.
    pub fn list(&self) -> Option<&[String]> {
        (!self.namespaces.is_empty()).then_some(&self.namespaces)
    }
}

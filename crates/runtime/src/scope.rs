//! Which namespaces the controllers of a manager watch.

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

    /// Namespaces to watch; `None` for all.
    pub fn list(&self) -> Option<&[String]> {
        (!self.namespaces.is_empty()).then_some(&self.namespaces)
    }
}

//! The built-in kinds `opkit create api --resource=false --controller` scaffolds a controller
//! for (Kubebuilder's `--group apps --version v1 --kind Deployment --resource=false`): each with
//! its k8s-openapi type, its place in RBAC and a sample the generated test creates.
use anyhow::bail;

/// A kind Kubernetes serves itself, with a type in `k8s_openapi::api`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Builtin {
    /// What `--group` says: `core` for the group without a name, else the group's first label
    /// (`networking` for `networking.k8s.io`), as in Kubebuilder.
    pub flag: &'static str,
    /// The API group: `""`, `apps`, `networking.k8s.io`.
    pub group: &'static str,
    /// `v1`.
    pub version: &'static str,
    /// `Deployment`.
    pub kind: &'static str,
    /// `deployments`: the resource in URLs and RBAC.
    pub plural: &'static str,
    /// Namespaced (true) or cluster-scoped.
    pub namespaced: bool,
    /// The module under `k8s_openapi::api` (`apps`, `core`, `networking`).
    pub module: &'static str,
    /// The sample's fields after `metadata` (YAML): a small object the apiserver accepts.
    pub body: &'static str,
}

impl Builtin {
    /// The type's path, e.g. `k8s_openapi::api::apps::v1::Deployment`.
    pub fn rust_path(&self) -> String {
        format!(
            "k8s_openapi::api::{}::{}::{}",
            self.module, self.version, self.kind
        )
    }

    /// `config/samples/<group>_<version>_<kind>.yaml`: what the generated test creates and
    /// `make dev` applies.
    pub fn sample(&self) -> String {
        format!(
            "apiVersion: {}\nkind: {}\nmetadata:\n  name: {}-sample\n{}",
            self.api_version(),
            self.kind,
            self.kind.to_lowercase(),
            self.body
        )
    }

    /// `apps/v1`, or `v1` for the core group.
    pub fn api_version(&self) -> String {
        match self.group {
            "" => self.version.to_string(),
            g => format!("{g}/{}", self.version),
        }
    }
}

/// The spec of a workload running one nginx (the Kubernetes documentation's Deployment).
macro_rules! workload {
    ($($extra:literal,)*) => {
        concat!(
            "spec:\n",
            $($extra,)*
            "  selector:\n    matchLabels:\n      app: nginx\n",
            "  template:\n    metadata:\n      labels:\n        app: nginx\n    spec:\n",
            "      containers:\n        - name: nginx\n          image: nginx:1.27\n",
        )
    };
}

/// Every built-in kind a controller can be scaffolded for.
pub const BUILTINS: &[Builtin] = &[
    core("ConfigMap", "configmaps", true, "data:\n  key: value\n"),
    core("Secret", "secrets", true, "stringData:\n  key: value\n"),
    core(
        "Service",
        "services",
        true,
        "spec:\n  selector:\n    app: nginx\n  ports:\n    - port: 80\n",
    ),
    core("ServiceAccount", "serviceaccounts", true, ""),
    core(
        "Pod",
        "pods",
        true,
        "spec:\n  containers:\n    - name: nginx\n      image: nginx:1.27\n",
    ),
    core(
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
        true,
        "spec:\n  accessModes: [ReadWriteOnce]\n  resources:\n    requests:\n      storage: 1Gi\n",
    ),
    core("Namespace", "namespaces", false, ""),
    apps("Deployment", "deployments", workload!("  replicas: 1\n",)),
    apps(
        "StatefulSet",
        "statefulsets",
        workload!("  serviceName: nginx\n",),
    ),
    apps("DaemonSet", "daemonsets", workload!()),
    apps("ReplicaSet", "replicasets", workload!("  replicas: 1\n",)),
    Builtin {
        flag: "batch",
        group: "batch",
        version: "v1",
        kind: "Job",
        plural: "jobs",
        namespaced: true,
        module: "batch",
        body: "spec:\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n        - name: hello\n          image: busybox:1.36\n          command: [sh, -c, \"date; echo Hello\"]\n",
    },
    Builtin {
        flag: "batch",
        group: "batch",
        version: "v1",
        kind: "CronJob",
        plural: "cronjobs",
        namespaced: true,
        module: "batch",
        body: "spec:\n  schedule: \"*/5 * * * *\"\n  jobTemplate:\n    spec:\n      template:\n        spec:\n          restartPolicy: Never\n          containers:\n            - name: hello\n              image: busybox:1.36\n              command: [sh, -c, \"date; echo Hello\"]\n",
    },
    Builtin {
        flag: "networking",
        group: "networking.k8s.io",
        version: "v1",
        kind: "Ingress",
        plural: "ingresses",
        namespaced: true,
        module: "networking",
        body: "spec:\n  defaultBackend:\n    service:\n      name: nginx\n      port:\n        number: 80\n",
    },
    Builtin {
        flag: "networking",
        group: "networking.k8s.io",
        version: "v1",
        kind: "NetworkPolicy",
        plural: "networkpolicies",
        namespaced: true,
        module: "networking",
        body: "spec:\n  podSelector: {}\n",
    },
];

const fn core(kind: &'static str, plural: &'static str, namespaced: bool, body: &'static str) -> Builtin {
    Builtin {
        flag: "core",
        group: "",
        version: "v1",
        kind,
        plural,
        namespaced,
        module: "core",
        body,
    }
}

const fn apps(kind: &'static str, plural: &'static str, body: &'static str) -> Builtin {
    Builtin {
        flag: "apps",
        group: "apps",
        version: "v1",
        kind,
        plural,
        namespaced: true,
        module: "apps",
        body,
    }
}

/// The built-in kind `--group`, `--version` and `--kind` name, or an error listing the ones
/// this scaffold knows.
pub fn find(group: &str, version: &str, kind: &str) -> anyhow::Result<Builtin> {
    if let Some(b) = BUILTINS
        .iter()
        .find(|b| (b.flag == group || (!b.group.is_empty() && b.group == group)) && b.kind == kind)
    {
        if b.version == version {
            return Ok(*b);
        }
        bail!(
            "--version {version:?}: {kind} is scaffolded in its served version {}; pass --version {}",
            b.api_version(),
            b.version
        );
    }
    let mut known = String::new();
    for flag in ["core", "apps", "batch", "networking"] {
        let kinds: Vec<&str> = BUILTINS
            .iter()
            .filter(|b| b.flag == flag)
            .map(|b| b.kind)
            .collect();
        known.push_str(&format!("\n  --group {flag} --version v1: {}", kinds.join(", ")));
    }
    bail!(
        "--resource=false scaffolds a controller for a built-in kind, and --group {group:?} --kind {kind:?} is not one this scaffold knows. Known:{known}\nFor a kind of this project, run `create api` without --resource=false; for another built-in kind, scaffold one of these and change its type, RBAC rule and sample."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Namespaced or cluster-scoped, from k8s-openapi's marker type.
    trait Scope {
        const NAMESPACED: bool;
    }
    impl Scope for k8s_openapi::NamespaceResourceScope {
        const NAMESPACED: bool = true;
    }
    impl Scope for k8s_openapi::ClusterResourceScope {
        const NAMESPACED: bool = false;
    }

    /// The entry of `K` names its type, group, plural and scope, and its sample reads as a `K`.
    fn check<K: k8s_openapi::Resource<Scope: Scope> + serde::de::DeserializeOwned>(path: &str) {
        let flag = match K::GROUP {
            "" => "core",
            g => g.split('.').next().unwrap_or(g),
        };
        let b = find(flag, K::VERSION, K::KIND).unwrap();
        assert_eq!(b.rust_path(), path.replace(' ', ""));
        assert_eq!(b.group, K::GROUP, "{path}");
        assert_eq!(b.api_version(), K::API_VERSION, "{path}");
        assert_eq!(b.plural, K::URL_PATH_SEGMENT, "{path}");
        assert_eq!(b.namespaced, <K::Scope as Scope>::NAMESPACED, "{path}");
        if let Err(e) = serde_yaml::from_str::<K>(&b.sample()) {
            panic!("{}\n{e}", b.sample());
        }
    }

    macro_rules! check {
        ($($t:path),* $(,)?) => {{
            let mut n = 0;
            $(check::<$t>(stringify!($t)); n += 1;)*
            n
        }};
    }

    #[test]
    fn every_builtin_matches_its_k8s_openapi_type_and_its_sample_reads_as_one() {
        let checked = check!(
            k8s_openapi::api::core::v1::ConfigMap,
            k8s_openapi::api::core::v1::Secret,
            k8s_openapi::api::core::v1::Service,
            k8s_openapi::api::core::v1::ServiceAccount,
            k8s_openapi::api::core::v1::Pod,
            k8s_openapi::api::core::v1::PersistentVolumeClaim,
            k8s_openapi::api::core::v1::Namespace,
            k8s_openapi::api::apps::v1::Deployment,
            k8s_openapi::api::apps::v1::StatefulSet,
            k8s_openapi::api::apps::v1::DaemonSet,
            k8s_openapi::api::apps::v1::ReplicaSet,
            k8s_openapi::api::batch::v1::Job,
            k8s_openapi::api::batch::v1::CronJob,
            k8s_openapi::api::networking::v1::Ingress,
            k8s_openapi::api::networking::v1::NetworkPolicy,
        );
        assert_eq!(checked, BUILTINS.len());
    }

    #[test]
    fn an_unknown_kind_is_refused_with_the_known_ones() {
        let e = find("apps", "v1", "Deploymnet").unwrap_err().to_string();
        assert!(
            e.contains("--group apps --version v1: Deployment, StatefulSet"),
            "{e}"
        );
        let e = find("core", "v2", "ConfigMap").unwrap_err().to_string();
        assert!(e.contains("pass --version v1"), "{e}");
        assert_eq!(
            find("networking.k8s.io", "v1", "Ingress").unwrap().plural,
            "ingresses"
        );
    }
}

//! A whole operator in one file: every Deployment labelled `example.opkit.dev/port=<port>` gets
//! a Service of the same name on that port, owned by the Deployment (deleted with it), put back
//! when someone changes or deletes it, and written only when it differs from the plan.
//!
//! ```text
//! make testenv-up                                # prints the KUBECONFIG to export
//! cargo run -p opkit --example expose -- run
//! kubectl create deployment web --image=nginx
//! kubectl label deployment web example.opkit.dev/port=80
//! kubectl get service web
//! ```
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;
use kube::{Client, Resource, ResourceExt};
use opkit::rbac::{events, rule};
use opkit::{
    Cache, Child, Event, Invalid, Operator, Plan, Reconciler, Registration, Registry, Requeue, Watch, Watches,
};

const PORT: &str = "example.opkit.dev/port";

struct Expose;

impl Reconciler for Expose {
    type Object = Deployment;
    type Caches = Cache<Service>;
    type World = Option<Arc<Service>>;
    type Status = ();

    fn name(&self) -> &'static str {
        "expose"
    }

    fn primary(&self) -> Watch<Deployment> {
        Watch::labels(PORT)
    }

    fn watch(&self, w: &mut Watches<Deployment>) -> Cache<Service> {
        w.owns(Watch::labels(PORT))
    }

    async fn observe(
        &self,
        d: &Deployment,
        services: &Cache<Service>,
        _: &Client,
    ) -> kube::Result<Self::World> {
        Ok(services.get(&d.namespace().unwrap_or_default(), &d.name_any()))
    }

    fn plan(&self, d: &Deployment, live: &Self::World, _: Timestamp) -> Result<Plan<()>, Invalid> {
        let label = d.labels().get(PORT).cloned().unwrap_or_default();
        let Some(port) = label.parse().ok().filter(|p| (1..=65535).contains(p)) else {
            let note = format!("label {PORT}={label:?} is not a port (1-65535)");
            return Ok(Plan::nothing(Requeue::OnChange).event(Event::warning("InvalidPort", "Expose", note)));
        };
        let selector = d.spec.as_ref().and_then(|s| s.selector.match_labels.clone());
        let service = Service {
            metadata: ObjectMeta {
                name: Some(d.name_any()),
                namespace: d.namespace(),
                labels: Some(BTreeMap::from([(PORT.to_string(), label)])),
                owner_references: d.controller_owner_ref(&()).map(|o| vec![o]),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                selector,
                ports: Some(vec![ServicePort {
                    port,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        Ok(Plan::nothing(Requeue::OnChange).child(Child::apply(&service, live.as_deref())))
    }
}

fn main() -> anyhow::Result<()> {
    let registry = Registry::new(vec![Registration {
        name: "expose",
        crds: Vec::new,
        rbac: || {
            vec![
                rule(&["apps"], &["deployments"], &["list", "watch"]),
                rule(&[""], &["services"], &["list", "watch", "create", "patch"]),
                events(),
            ]
        },
        webhooks: |w| w,
        add: |m, _| {
            m.add(Expose);
        },
    }]);
    let operator = Operator {
        name: "expose",
        version: "0.1.0",
        about: "Services for labelled Deployments",
        registry,
    };
    opkit::cli::main(operator, |_: &opkit::cli::NoArgs| ())
}

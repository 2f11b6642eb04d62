//! Asks the API server what this identity may do (the effectful half of [`super::permissions`]).

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use kube::api::{Api, PostParams};

use super::permissions::{NEEDED, Permission};
use crate::source::kube::KubeSourceError;

/// Who the client is (its username, or `this identity` when the server will not say) and the
/// permissions of [`NEEDED`] it is denied.
pub(crate) async fn denied(kubeconfig: Option<&str>) -> Result<(String, Vec<Permission>), KubeSourceError> {
    let client = crate::source::kube::client(kubeconfig, None).await?;
    let who = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .ok()
        .and_then(|r| r.status?.user_info?.username)
        .unwrap_or_else(|| "this identity".to_string());
    let reviews = Api::<SelfSubjectAccessReview>::all(client);
    let mut denied = Vec::new();
    for need in NEEDED {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(need.verb.to_string()),
                    group: Some(need.group.to_string()),
                    resource: Some(need.resource.to_string()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let allowed = reviews.create(&PostParams::default(), &review).await?.status.is_some_and(|s| s.allowed);
        if !allowed {
            denied.push(*need);
        }
    }
    Ok((who, denied))
}

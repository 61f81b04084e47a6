//! The [`Reviewer`] that asks the API server: TokenReview and SubjectAccessReview. The brain's
//! account needs `create` on `tokenreviews` (authentication.k8s.io) and on
//! `subjectaccessreviews` (authorization.k8s.io).
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::PostParams;

use super::{
    BoxFuture, INTROSPECTION_GROUP, INTROSPECTION_RESOURCE, INTROSPECTION_VERB, ReviewError,
    Reviewer, TokenReviewed, UserInfo,
};

/// Reviews through the API server the brain watches.
pub struct ApiReviewer {
    client: kube::Client,
}

impl ApiReviewer {
    pub fn new(client: kube::Client) -> Self {
        ApiReviewer { client }
    }
}

impl Reviewer for ApiReviewer {
    fn review_token<'a>(
        &'a self,
        token: &'a str,
        audience: &'a str,
    ) -> BoxFuture<'a, Result<TokenReviewed, ReviewError>> {
        Box::pin(async move {
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: token.to_string(),
                    audiences: Some(vec![audience.to_string()]),
                },
                ..Default::default()
            };
            let answer = Api::<TokenReview>::all(self.client.clone())
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| ReviewError(e.to_string()))?;
            let status = answer.status.unwrap_or_default();
            if status.authenticated != Some(true) {
                return Ok(TokenReviewed::Unauthenticated(
                    status.error.unwrap_or_default(),
                ));
            }
            // An audience-aware API server answers with the audiences the token is valid for
            // among those asked; none means "the API server's own audience", not ours.
            if !status
                .audiences
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|a| a == audience)
            {
                return Ok(TokenReviewed::Unauthenticated(format!(
                    "the token is not valid for audience {audience:?} (TokenReview answered audiences {:?})",
                    status.audiences.unwrap_or_default()
                )));
            }
            let user = status.user.unwrap_or_default();
            Ok(TokenReviewed::Authenticated(UserInfo {
                username: user.username.unwrap_or_default(),
                uid: user.uid.unwrap_or_default(),
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }))
        })
    }

    fn may_introspect<'a>(
        &'a self,
        user: &'a UserInfo,
    ) -> BoxFuture<'a, Result<bool, ReviewError>> {
        Box::pin(async move {
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(user.username.clone()),
                    uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
                    groups: Some(user.groups.clone()),
                    extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(INTROSPECTION_GROUP.to_string()),
                        resource: Some(INTROSPECTION_RESOURCE.to_string()),
                        verb: Some(INTROSPECTION_VERB.to_string()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let answer = Api::<SubjectAccessReview>::all(self.client.clone())
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| ReviewError(e.to_string()))?;
            Ok(answer.status.is_some_and(|s| s.allowed))
        })
    }
}

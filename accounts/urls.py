from django.urls import path

from accounts import views

urlpatterns = [
    path("tokens/", views.token_list, name="token_list"),
    path("tokens/<int:token_id>/revoke/", views.token_revoke, name="token_revoke"),
    path("keys/", views.key_list, name="key_list"),
    path("keys/<int:key_id>/delete/", views.key_delete, name="key_delete"),
    path("keys/username/", views.unix_username, name="unix_username"),
]

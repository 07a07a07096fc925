from django.urls import path

from accounts import views

urlpatterns = [
    path("tokens/", views.token_list, name="token_list"),
    path("tokens/<int:token_id>/revoke/", views.token_revoke, name="token_revoke"),
]

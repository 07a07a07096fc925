from django.urls import path

from accounts import views

urlpatterns = [
    path("tokens/", views.token_list, name="token_list"),
]

module kvmount.invalid/vault-server

go 1.26

require (
	github.com/hashicorp/vault v1.16.3
	github.com/hashicorp/vault/api v1.12.0
	github.com/hashicorp/vault/sdk v0.12.0
)

replace github.com/ma314smith/signedxml v1.1.1 => github.com/moov-io/signedxml v1.1.1

package vault

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/hashicorp/vault/api"
)

// ResponseError is a Vault error response as kvmount reports it: the status
// and the server's messages, without the request's URL, headers or body —
// the API client's own error spans lines and repeats the URL. The
// messages are the server's words: bounded here, escaped where they are
// shown (package untrusted).
type ResponseError struct {
	// Status is the HTTP status code.
	Status int
	// Messages are the server's errors, joined with "; ", at most
	// maxMessage bytes.
	Messages string
}

// maxMessage is the most bytes of a server's messages kept in an error.
const maxMessage = 256

// Error returns "STATUS TEXT: messages".
func (e *ResponseError) Error() string {
	msg := fmt.Sprintf("%d %s", e.Status, http.StatusText(e.Status))
	if e.Messages != "" {
		msg += ": " + e.Messages
	}
	return msg
}

// describe returns err as kvmount reports it: an *api.ResponseError as a
// *ResponseError, a *url.Error without the URL (its path names a secret,
// its query nothing kvmount needs shown); other errors as they are.
func describe(err error) error {
	if err == nil {
		return nil
	}
	var re *api.ResponseError
	if errors.As(err, &re) {
		msg := strings.Join(re.Errors, "; ")
		if len(msg) > maxMessage {
			msg = msg[:maxMessage] + "…"
		}
		return &ResponseError{Status: re.StatusCode, Messages: msg}
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// statusOf returns the HTTP status of a Vault error response, 0 for any
// other error.
func statusOf(err error) int {
	var re *api.ResponseError
	if errors.As(err, &re) {
		return re.StatusCode
	}
	var own *ResponseError
	if errors.As(err, &own) {
		return own.Status
	}
	return 0
}

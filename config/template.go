package config

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/kvmount/kvmount/projector"
)

// templateLine finds the line in text/template's errors after the
// template's name: "LINE: message" or "LINE:COL: message".
var templateLine = regexp.MustCompile(`^(\d+):(?:\d+:)? (.*)$`)

// decodeTemplates decodes the [[mount.templates]] entries of m: path,
// mode, and exactly one of file (a Go text/template file, read now — at
// start and on every reload) or text (inline). paths holds the item paths
// of the mount's projections; a template path that collides with one of
// them or with another template's is an error naming both. A call of
// secret whose path no Vault projection of m holds is an error at its
// line (checkSecretCalls).
func decodeTemplates(sec *Section, paths map[string]bool, m *Mount, cfg *Config) []*projector.Template {
	var out []*projector.Template
	byPath := map[string]string{}
	for i, tsec := range sec.Tables("templates") {
		t := decodeTemplate(tsec)
		tsec.Done()
		if t == nil {
			continue
		}
		checkSecretCalls(tsec, t, m, cfg)
		switch {
		case paths[t.Path]:
			tsec.Errorf("path", "%q is also the path of an item", t.Path)
		case byPath[t.Path] != "":
			tsec.Errorf("path", "%q is also the path of %s", t.Path, byPath[t.Path])
		default:
			byPath[t.Path] = fmt.Sprintf("templates[%d]", i)
			out = append(out, t)
		}
	}
	return out
}

// textStart returns the config file's line of the first line of the text
// key's value: a multi-line string ("""…) drops the newline right after its
// opening quotes (TOML), so its text starts on the next line.
func textStart(sec *Section) int {
	line := sec.Line("text")
	lines := strings.Split(sec.doc.src, "\n")
	if line > 0 && line <= len(lines) {
		if t := strings.TrimSpace(lines[line-1]); strings.HasSuffix(t, `"""`) || strings.HasSuffix(t, "'''") {
			return line + 1
		}
	}
	return line
}

// templateFileLimit is the largest template file read, in bytes.
const templateFileLimit = 1 << 20

// decodeTemplate decodes and parses one entry; nil when it has a problem
// (recorded at its line).
func decodeTemplate(sec *Section) *projector.Template {
	path := sec.String("path", "")
	mode := sec.Mode("mode", 0)
	file := sec.String("file", "")
	text := sec.String("text", "")
	switch {
	case path == "":
		sec.Errorf("", "a template needs path, where the rendered file lands in the mount")
		return nil
	case sec.Has("file") == sec.Has("text"):
		sec.Errorf("", "a template needs exactly one of file and text")
		return nil
	}
	origin := file
	if file != "" {
		data, _, err := sec.doc.files.Read(file, templateFileLimit)
		if err != nil {
			sec.Errorf("file", "%v", err)
			return nil
		}
		text = string(data)
	} else {
		origin = fmt.Sprintf("%s:%d", sec.doc.file, sec.Line("text"))
	}
	t, err := projector.ParseTemplate(origin, path, text, mode)
	if err != nil {
		if file == "" {
			// Report it at the config file's line of the template's line.
			rest := strings.TrimPrefix(err.Error(), "template: "+origin+":")
			if m := templateLine.FindStringSubmatch(rest); m != nil {
				n, _ := strconv.Atoi(m[1])
				sec.doc.add(textStart(sec)+n-1, sec.keyName("text"), "template: %s", m[2])
				return nil
			}
		}
		sec.Errorf(map[bool]string{true: "file", false: "text"}[file != ""], "%v", err)
		return nil
	}
	return t
}

// SecretHolder is implemented by source settings whose projections read
// secrets that templates read with secret (Vault): HoldsSecret reports
// whether the projection of prefix holds the secret a template names with
// path and params (string literals in the template).
type SecretHolder interface {
	HoldsSecret(prefix, path string, params []string) bool
}

// checkSecretCalls reports, at its line, each call of secret in t whose
// path — a string literal — no projection of m holds: templates read only
// what the mount's own projections read, so they stay hermetic. A path
// that is not a literal is checked when the template renders.
func checkSecretCalls(sec *Section, t *projector.Template, m *Mount, cfg *Config) {
	for _, call := range t.SecretCalls() {
		if call.Path == "" {
			continue
		}
		held := false
		for _, pr := range m.Projections {
			if h, ok := sourceSettings(cfg.Sources[pr.Source]).(SecretHolder); ok && h.HoldsSecret(pr.Prefix, call.Path, call.Params) {
				held = true
				break
			}
		}
		if held {
			continue
		}
		msg := fmt.Sprintf("secret %q: no Vault projection of mount %s holds it; a template reads only what the mount's projections read (add one whose prefix or [mount.pki] covers it)", call.Path, m.Name)
		if len(call.Params) > 0 {
			msg = fmt.Sprintf("secret %q %s: no [mount.pki] projection of mount %s issues with these parameters; a template reads only what the mount's projections read", call.Path, strings.Join(call.Params, " "), m.Name)
		}
		if sec.Has("text") {
			sec.doc.add(textStart(sec)+call.Line-1, sec.keyName("text"), "template: %s", msg)
			continue
		}
		sec.Errorf("file", "template: %s:%d: %s", t.Origin, call.Line, msg)
	}
}

// Command celcost reports the static CEL cost estimates that the kube-apiserver computes for the
// x-kubernetes-validations rules of a CustomResourceDefinition when the CRD is created.
//
// Usage: celcost [-no-validate] CRD.yaml   (JSON report on stdout)
//
// It links the API server's own code (k8s.io/apiextensions-apiserver, the version in go.mod) and
// walks each version's openAPIV3Schema the way ValidateCustomResourceDefinitionOpenAPISchema does
// (pkg/apis/apiextensions/validation/validation.go): the same CEL schema contexts, the same
// compiler, base environment and per-call limit, the same cardinality multiplication. It then runs
// validation.ValidateCustomResourceDefinition on the same object to say whether the server would
// accept the CRD at all.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"runtime/debug"
	"sort"
	"strings"
	"unicode/utf8"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/install"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/cel/environment"
	"sigs.k8s.io/yaml"
)

const ruleTextLimit = 120

// Expression is one compiled CEL expression (a rule or a messageExpression) and its estimated cost.
type Expression struct {
	Path string `json:"path"`
	Kind string `json:"kind"` // "rule" or "messageExpression"
	Rule string `json:"rule"` // the expression text, first 120 characters
	// Cost is what the server compares with the per-rule limit and adds to the per-CRD total.
	Cost                   uint64  `json:"cost"`
	FractionOfPerRuleLimit float64 `json:"fractionOfPerRuleLimit"`
	// PerCallCost is the cost of one evaluation (CompilationResult.MaxCost / MessageExpressionMaxCost).
	PerCallCost uint64 `json:"perCallCost"`
	// Cardinality is how many times the server assumes the rule runs per object: the product of
	// maxItems/maxProperties above it, or (null) unbounded, when some list or map above it has none.
	Cardinality *uint64 `json:"cardinality"`
	// Multiplier is the factor applied to PerCallCost: Cardinality, or when unbounded the largest
	// number of values that fit in a request (CompilationResult.MaxCardinality). 1 for messageExpressions.
	Multiplier uint64 `json:"multiplier"`
	Error      string `json:"error,omitempty"`
}

// VersionReport is the cost report of one version's schema.
type VersionReport struct {
	Name                      string       `json:"name"`
	Expressions               []Expression `json:"rules"`
	Total                     uint64       `json:"total"`
	TotalFractionOfCRDLimit   float64      `json:"totalFractionOfPerCRDLimit"`
	MaxFractionOfPerRuleLimit float64      `json:"maxFractionOfPerRuleLimit"`
}

// Report is the tool's output.
type Report struct {
	CRD                     string          `json:"crd"`
	APIExtensionsVersion    string          `json:"apiextensionsApiserverVersion"`
	CELCompatibilityVersion string          `json:"celCompatibilityVersion"`
	PerRuleLimit            uint64          `json:"perRuleLimit"`
	PerCRDLimit             uint64          `json:"perCRDLimit"`
	Versions                []VersionReport `json:"versions"`
	// Accepted is ValidateCustomResourceDefinition's verdict (null when -no-validate).
	Accepted         *bool    `json:"accepted"`
	ValidationErrors []string `json:"validationErrors"`
}

func main() {
	noValidate := flag.Bool("no-validate", false, "skip validation.ValidateCustomResourceDefinition")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s [-no-validate] CRD.yaml\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	crd, err := loadCRD(flag.Arg(0))
	if err != nil {
		fmt.Fprintf(os.Stderr, "celcost: %s: %v\n", flag.Arg(0), err)
		os.Exit(2)
	}
	report := buildReport(crd, !*noValidate)
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	if err := out.Encode(report); err != nil {
		fmt.Fprintf(os.Stderr, "celcost: %v\n", err)
		os.Exit(1)
	}
}

// loadCRD reads an apiextensions.k8s.io/v1 CRD, applies the v1 defaults and converts it to the
// internal type, as the API server does when it decodes a create request, then sets the status the
// way the registry's PrepareForCreate does (stored version = the storage version).
func loadCRD(path string) (*apiextensions.CustomResourceDefinition, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	external := &apiextensionsv1.CustomResourceDefinition{}
	if err := yaml.UnmarshalStrict(data, external); err != nil {
		return nil, err
	}
	scheme := runtime.NewScheme()
	install.Install(scheme)
	scheme.Default(external)
	crd := &apiextensions.CustomResourceDefinition{}
	if err := scheme.Convert(external, crd, nil); err != nil {
		return nil, err
	}
	crd.Status = apiextensions.CustomResourceDefinitionStatus{}
	crd.Generation = 1
	for _, v := range crd.Spec.Versions {
		if v.Storage {
			crd.Status.StoredVersions = []string{v.Name}
			break
		}
	}
	return crd, nil
}

func buildReport(crd *apiextensions.CustomResourceDefinition, validate bool) Report {
	envSet := newCRDEnvSet()
	report := Report{
		CRD:                     crd.Name,
		APIExtensionsVersion:    moduleVersion("k8s.io/apiextensions-apiserver"),
		CELCompatibilityVersion: environment.DefaultCompatibilityVersion().String(),
		PerRuleLimit:            validation.StaticEstimatedCostLimit,
		PerCRDLimit:             validation.StaticEstimatedCRDCostLimit,
		ValidationErrors:        []string{},
	}
	if crd.Spec.Validation != nil && crd.Spec.Validation.OpenAPIV3Schema != nil {
		// When every version has the same schema, the v1 -> internal conversion hoists it to
		// spec.validation and the server checks it once: report it once, named by all versions.
		names := make([]string, 0, len(crd.Spec.Versions))
		for _, v := range crd.Spec.Versions {
			names = append(names, v.Name)
		}
		name := strings.Join(names, ",")
		report.Versions = append(report.Versions, versionCosts(name, crd.Spec.Validation.OpenAPIV3Schema, envSet))
	}
	for _, v := range crd.Spec.Versions {
		if v.Schema == nil || v.Schema.OpenAPIV3Schema == nil {
			continue
		}
		report.Versions = append(report.Versions, versionCosts(v.Name, v.Schema.OpenAPIV3Schema, envSet))
	}
	if validate {
		errs := validation.ValidateCustomResourceDefinition(context.Background(), crd)
		accepted := len(errs) == 0
		report.Accepted = &accepted
		for _, e := range errs {
			report.ValidationErrors = append(report.ValidationErrors, truncate(e.Error(), 400))
		}
	}
	return report
}

// newCRDEnvSet is the environment set ValidateCustomResourceDefinition builds (opts.celEnvironmentSet):
// the base environment at the default compatibility version, with strict cost always on.
func newCRDEnvSet() *environment.EnvSet {
	return environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion(), true)
}

func versionCosts(name string, schema *apiextensions.JSONSchemaProps, envSet *environment.EnvSet) VersionReport {
	root := validation.RootCELContext(schema)
	var exprs []Expression
	walk(schema, field.NewPath("openAPIV3Schema"), root, envSet, &exprs)
	sort.SliceStable(exprs, func(i, j int) bool { return exprs[i].Cost > exprs[j].Cost })
	rep := VersionReport{
		Name:                    name,
		Expressions:             exprs,
		Total:                   root.TotalCost.Total,
		TotalFractionOfCRDLimit: fraction(root.TotalCost.Total, validation.StaticEstimatedCRDCostLimit),
	}
	if rep.Expressions == nil {
		rep.Expressions = []Expression{}
	}
	for _, e := range exprs {
		rep.MaxFractionOfPerRuleLimit = math.Max(rep.MaxFractionOfPerRuleLimit, e.FractionOfPerRuleLimit)
	}
	return rep
}

// walk mirrors the recursion of validation.ValidateCustomResourceDefinitionOpenAPISchema for the
// parts that carry a CEL context (additionalProperties, properties, items); not/allOf/oneOf/anyOf/
// definitions/dependencies get a nil context there, so their rules are never compiled. Property
// names are visited in sorted order (the server's map order is random; costs do not depend on it).
func walk(schema *apiextensions.JSONSchemaProps, path *field.Path, ctx *validation.CELSchemaContext,
	envSet *environment.EnvSet, out *[]Expression) {
	if schema == nil {
		return
	}
	if schema.AdditionalProperties != nil {
		child := schema.AdditionalProperties.Schema
		walk(child, path.Child("additionalProperties"), ctx.ChildAdditionalPropertiesContext(child), envSet, out)
	}
	names := make([]string, 0, len(schema.Properties))
	for name := range schema.Properties {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		prop := schema.Properties[name]
		walk(&prop, path.Child("properties").Key(name), ctx.ChildPropertyContext(&prop, name), envSet, out)
	}
	if schema.Items != nil {
		walk(schema.Items.Schema, path.Child("items"), ctx.ChildItemsContext(schema.Items.Schema), envSet, out)
		for i := range schema.Items.JSONSchemas {
			item := schema.Items.JSONSchemas[i]
			walk(&item, path.Child("items").Index(i), ctx.ChildItemsContext(&item), envSet, out)
		}
	}
	if len(schema.XValidations) > 0 {
		*out = append(*out, compileRules(schema, path, ctx, envSet)...)
	}
}

// compileRules compiles one schema node's rules exactly as validation.go does (same arguments to
// cel.Compile; a new CRD has no pre-existing expressions, so every expression gets the "new
// expressions" environment) and observes their costs on the context's TotalCost in the same way.
func compileRules(schema *apiextensions.JSONSchemaProps, path *field.Path, ctx *validation.CELSchemaContext,
	envSet *environment.EnvSet) []Expression {
	rulesPath := path.Child("x-kubernetes-validations")
	typeInfo, err := ctx.TypeInfo()
	if err != nil || typeInfo == nil {
		msg := "no CEL type information for this schema node"
		if err != nil {
			msg = err.Error()
		}
		return []Expression{{Path: rulesPath.String(), Kind: "rule", Error: msg}}
	}
	results, err := cel.Compile(typeInfo.Schema, typeInfo.DeclType, celconfig.PerCallLimit, envSet, cel.NewExpressionsEnvLoader())
	if err != nil {
		return []Expression{{Path: rulesPath.String(), Kind: "rule", Error: err.Error()}}
	}
	var out []Expression
	for i, cr := range results {
		rulePath := rulesPath.Index(i).Child("rule")
		cost := expressionCost(cr, ctx)
		ctx.TotalCost.ObserveExpressionCost(rulePath, cost)
		e := Expression{
			Path: rulePath.String(), Kind: "rule", Rule: truncate(schema.XValidations[i].Rule, ruleTextLimit),
			Cost: cost, FractionOfPerRuleLimit: fraction(cost, validation.StaticEstimatedCostLimit),
			PerCallCost: cr.MaxCost, Cardinality: ctx.MaxCardinality, Multiplier: multiplier(cr, ctx),
		}
		if cr.Error != nil {
			e.Error = cr.Error.Detail
		}
		out = append(out, e)
		if cr.MessageExpressionError != nil || cr.MessageExpression == nil {
			continue
		}
		// the server adds a messageExpression's per-call cost to the total without any cardinality
		msgPath := rulesPath.Index(i).Child("messageExpression")
		ctx.TotalCost.ObserveExpressionCost(msgPath, cr.MessageExpressionMaxCost)
		out = append(out, Expression{
			Path: msgPath.String(), Kind: "messageExpression",
			Rule:                   truncate(schema.XValidations[i].MessageExpression, ruleTextLimit),
			Cost:                   cr.MessageExpressionMaxCost,
			FractionOfPerRuleLimit: fraction(cr.MessageExpressionMaxCost, validation.StaticEstimatedCostLimit),
			PerCallCost:            cr.MessageExpressionMaxCost, Cardinality: ctx.MaxCardinality, Multiplier: 1,
		})
	}
	return out
}

// expressionCost mirrors the unexported getExpressionCost in validation.go: the per-call cost times
// the schema node's cardinality, or times the rule's own worst-case cardinality when unbounded.
func expressionCost(cr cel.CompilationResult, ctx *validation.CELSchemaContext) uint64 {
	return multiplyWithOverflowGuard(cr.MaxCost, multiplier(cr, ctx))
}

func multiplier(cr cel.CompilationResult, ctx *validation.CELSchemaContext) uint64 {
	if ctx.MaxCardinality != nil { // nil is validation.go's "unbounded"
		return *ctx.MaxCardinality
	}
	return cr.MaxCardinality
}

// multiplyWithOverflowGuard mirrors the unexported function of the same name in validation.go.
func multiplyWithOverflowGuard(baseCost, cardinality uint64) uint64 {
	if baseCost == 0 {
		return 0
	} else if math.MaxUint64/baseCost < cardinality {
		return math.MaxUint64
	}
	return baseCost * cardinality
}

func fraction(cost, limit uint64) float64 {
	return float64(cost) / float64(limit)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

func moduleVersion(path string) string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	for _, dep := range info.Deps {
		if dep.Path == path {
			return dep.Version
		}
	}
	return "unknown"
}
